"""The names the command line offers before anything heavy is imported (`dsv3lite --help` must not wait for torch):
the routed-expert formats (formats.py registers a class for each) and int4's group sizes (int4.py)."""

FORMATS = ("bf16", "fp8", "int4", "int8", "nf4")
INT4_GROUP_SIZES = (32, 64, 128)
