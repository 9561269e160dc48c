"""The benchmark suite behind ``adaptive-eager bench``: eager vs adaptive vs torch.compile.

``workloads`` builds each computation at a named size; ``child`` measures one workload × size ×
mode in a fresh process; ``runner`` plans the runs, starts the children and checks their outputs
against eager; ``results`` derives ratios and break-even points; ``report`` prints the table and
writes JSON, markdown and the plot. ``scenarios`` (``bench --scenarios``) states the adaptive
policy's promises as targets and checks them against what ``scenario_child`` and
``first_steps`` measure in fresh processes. Nothing here imports torch at import time.
"""
