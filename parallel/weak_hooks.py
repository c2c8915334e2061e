"""Hooks that do not keep their owner alive.

A parameter's gradient hooks are held by its C++ tensor, where Python's garbage collector cannot follow them:
a hook bound to the object that owns the parameters (a DDP or FSDP wrapper) closes a cycle the collector never
breaks, and every Trainer a process builds would keep its model, its buffers and its process groups' threads
and sockets to the end. These hooks call their method through a weak reference instead; once the owner is
gone they do nothing.
"""
from __future__ import annotations

import weakref


def weak_method(method):
    """A callable that calls the bound `method` with its arguments while its object lives."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call
