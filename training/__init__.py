"""Training programs for the checkpoints the workbench ships (never imported by `engine` or CI).

`python -m training.demo_model --out DIR` trains the built-in demo model: the K3.1 architecture at
a size that trains on a 2-core CPU, on retrieval tasks generated on the fly, through the engine's
own pure-torch layers, and writes it in the real on-disk layout with MXFP4 experts.
"""
