"""Generated Python code for the Open Inference Protocol (KServe v2) over gRPC, package
``inference`` (``grpc_predict_v2.proto``), which laneserve answers beside laneserve.v1.

Regenerate with ``scripts/gen_protos``; never edit the ``*_pb2*`` modules by hand.
"""
