"""The laneserve client: typed access to a laneserve server over gRPC.

The wire codec (numpy arrays to and from ``laneserve.v1.Tensor``) lives in
:mod:`laneserve.client.tensors` and is shared with the server.
"""

from laneserve.client.tensors import (
    DataType,
    datatype_for_onnx_type,
    datatype_name,
    datatype_of,
    decode_tensor,
    encode_tensor,
    numpy_dtype,
    numpy_dtype_for_onnx_type,
    onnx_type,
)

__all__ = [
    "DataType",
    "datatype_for_onnx_type",
    "datatype_name",
    "datatype_of",
    "decode_tensor",
    "encode_tensor",
    "numpy_dtype",
    "numpy_dtype_for_onnx_type",
    "onnx_type",
]
