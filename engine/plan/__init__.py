"""The layout planner: every valid TP × CP × PP × DP × ZeRO × recompute × micro-batch layout for a world size,
the ones that fit (engine/memory_estimate.py), and their step time from a calibrated device profile.

    layouts.enumerate_layouts   the candidates, each checked by engine/config/schema.validate
    fit.peak_bytes / fits        the fit filter: the memory estimate's fullest rank with a stated margin
    profile.DeviceProfile        a device's measured (or stated) compute, optimizer and link speeds (JSON)
    time_model.predict           step time split into compute, exposed communication, bubble and optimizer
    planner.plan / warning       ranked predictions; the pre-flight's "far from the best" warning
"""
