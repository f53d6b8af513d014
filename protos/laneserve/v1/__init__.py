"""Generated Python code for the laneserve.v1 wire contract (``inference.proto``).

Regenerate with ``scripts/gen_protos``; never edit the ``*_pb2*`` modules by hand.
"""
