"""What the planner reads, measured: model statistics, host calibration, probes, MFU's inputs.

The planner (``polytrain.planner``) is pure numbers and never imports this package; this
package runs torch (meta, CPU or GPU) and, for calibration, real strategies, and produces the
``ModelStats`` and ``HostProfile`` values (``planner.types``) the planner prices.
"""
