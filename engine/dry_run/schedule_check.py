"""The recorded collective schedules of simulated ranks, checked the way NCCL would run them.

Three checks, in order, each stopping at its first violation with one line (the group's ranks, the operation's
index, what each side issued):
1. every simulated member of a group (a communicator: its ranks and its name) issues the same sequence of
   collectives (op, dtype, element count);
2. every send has a receive on its peer, k-th for k-th on that pair of ranks, of the same shape and dtype;
3. the whole schedule runs to its end when each operation blocks as NCCL's do: a collective until every member
   has reached it, a batch of sends and receives (one batch_isend_irecv) until each of its transfers has met its
   partner in the peer's current batch.
Members or peers outside the simulated ranks are not waited for (a covering sample simulates every tensor-,
context- and pipeline-parallel group of two replicas whole, and two members of each data-parallel group).

A schedule is {rank: [event row]}, rows as engine/dry_run/rank_program.event_row writes them:
(op, group ranks, dtype, count, shape, peer, batch, group name).
"""
from __future__ import annotations

from collections import defaultdict

P2P = ("send", "recv")


def describe(row) -> str:
    op, _, dtype, count, shape, peer, _, _ = row
    if op in P2P:
        return f"{op} {dtype}{list(shape)} {'to' if op == 'send' else 'from'} rank {peer}"
    return f"{op} of {count} {dtype}"


def collective_problem(schedule: dict) -> str | None:
    """Check 1: the first group whose simulated members' collective sequences differ."""
    by_group: dict = defaultdict(dict)
    for rank, rows in schedule.items():
        for row in rows:
            if row[0] not in P2P:
                by_group[row[1], row[7]].setdefault(rank, []).append(row)
    for (ranks, _), members in sorted(by_group.items()):
        missing = [r for r in ranks if r in schedule and r not in members]
        for r in missing:
            members[r] = []
        first = min(members)
        for other in sorted(members):
            a, b = members[first], members[other]
            for i in range(max(len(a), len(b))):
                mine = (a[i][0], a[i][2], a[i][3]) if i < len(a) else None  # op, dtype, count
                theirs = (b[i][0], b[i][2], b[i][3]) if i < len(b) else None
                if mine != theirs:
                    name = (a or b)[0][7]
                    return (f"group {name} {list(ranks)}: collective #{i}: rank {first} issued "
                            f"{describe(a[i]) if i < len(a) else 'nothing'}, rank {other} issued "
                            f"{describe(b[i]) if i < len(b) else 'nothing'}")
    return None


def p2p_problem(schedule: dict) -> tuple[str | None, int]:
    """Check 2: the first send without its receive (or the reverse); and how many transfers had a peer
    outside the simulated ranks (not checked)."""
    channels: dict = defaultdict(lambda: ([], []))  # (src, dst) -> (sends, recvs)
    unchecked = 0
    for rank, rows in schedule.items():
        for row in rows:
            if row[0] not in P2P:
                continue
            if row[5] not in schedule:
                unchecked += 1
                continue
            key = (rank, row[5]) if row[0] == "send" else (row[5], rank)
            channels[key][0 if row[0] == "send" else 1].append(row)
    for (src, dst), (sends, recvs) in sorted(channels.items()):
        for i in range(max(len(sends), len(recvs))):
            sent = (sends[i][4], sends[i][2]) if i < len(sends) else None
            received = (recvs[i][4], recvs[i][2]) if i < len(recvs) else None
            if sent != received:
                return (f"pipeline ranks {src}->{dst}: transfer #{i}: rank {src} issued "
                        f"{describe(sends[i]) if sent else 'no send'}, rank {dst} issued "
                        f"{describe(recvs[i]) if received else 'no receive'}"), unchecked
    return None, unchecked


def programs(schedule: dict) -> dict:
    """{rank: [step]}: a step is ("c", (group ranks, name), k, row) for the group's k-th collective, or ("p", [(kind,
    peer, k)], row) for a batch of transfers, the k-th on its pair of ranks in its direction."""
    out = {}
    for rank, rows in schedule.items():
        steps, per_group, per_pair = [], defaultdict(int), defaultdict(int)
        for row in rows:
            if row[0] not in P2P:
                group = (row[1], row[7])
                steps.append(("c", group, per_group[group], row))
                per_group[group] += 1
                continue
            key = (row[0], row[5])
            op = (row[0], row[5], per_pair[key])
            per_pair[key] += 1
            if steps and steps[-1][0] == "p" and steps[-1][3][6] == row[6]:
                steps[-1][1].append(op)
            else:
                steps.append(("p", [op], None, row))
        out[rank] = steps
    return out


def deadlock_problem(schedule: dict) -> str | None:
    """Check 3: run every program with blocking operations; the first rank left waiting, if any."""
    progs, at, done = programs(schedule), {r: 0 for r in schedule}, set()

    def current(rank):
        return progs[rank][at[rank]] if at[rank] < len(progs[rank]) else None

    def advance(rank) -> bool:
        step = current(rank)
        if step is None:
            return False
        if step[0] == "c":
            members = [m for m in step[1][0] if m in schedule]
            if all((s := current(m)) is not None and s[0] == "c" and s[1] == step[1] and s[2] == step[2]
                   for m in members):
                for m in members:
                    at[m] += 1
                return True
            return False
        for kind, peer, k in step[1]:
            if (rank, kind, peer, k) in done:
                continue
            partner = ("recv" if kind == "send" else "send", rank, k)
            theirs = current(peer) if peer in schedule else None
            if peer not in schedule or (theirs is not None and theirs[0] == "p" and partner in theirs[1]):
                done.add((rank, kind, peer, k))
                done.add((peer, partner[0], rank, k))
        if all((rank, kind, peer, k) in done for kind, peer, k in step[1]):
            at[rank] += 1
            return True
        return False

    progress = True
    while progress:
        progress = False
        for rank in schedule:
            while advance(rank):
                progress = True
    stuck = [r for r in schedule if current(r) is not None]
    if not stuck:
        return None
    rank = stuck[0]
    step = current(rank)
    peers = sorted({m for m in step[1][0] if m in schedule} if step[0] == "c" else
                   {peer for _, peer, _ in step[1] if peer in schedule}) or [rank]
    waits = ", ".join(f"rank {p} at {describe(current(p)[3]) if current(p) else 'its end'}"
                      for p in peers if p != rank)
    name = step[3][7]
    return (f"deadlock: rank {rank} waits in {name} {list(step[3][1])} at operation #{at[rank]} "
            f"({describe(step[3])}); {waits or 'no peer reaches it'}")


def check(schedule: dict) -> tuple[str | None, int]:
    """The first violation of checks 1-3 (None: the schedule is consistent and cannot deadlock), and how many
    transfers had an unsimulated peer."""
    problem = collective_problem(schedule)
    p2p, unchecked = p2p_problem(schedule)
    return problem or p2p or deadlock_problem(schedule), unchecked
