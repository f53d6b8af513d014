"""The committed generated code matches the .proto files, and the demo model is servable."""

import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from laneserve.server.demo_model import make_demo_model
from laneserve.v1 import inference_pb2, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_matches_the_protos() -> None:
    result = subprocess.run(
        [ROOT / "scripts" / "gen_protos", "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr


def test_generated_code_is_imported_as_laneserve_v1() -> None:
    assert inference_pb2.DESCRIPTOR.package == "laneserve.v1"
    service = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
    assert [m.name for m in service.methods] == ["Infer", "InferStream", "GetModel", "GetStats"]
    assert inference_pb2_grpc.InferenceServiceStub.__module__ == "laneserve.v1.inference_pb2_grpc"


@pytest.fixture(scope="module")
def demo_session(tmp_path_factory: pytest.TempPathFactory) -> ort.InferenceSession:
    path = tmp_path_factory.mktemp("model") / "demo.onnx"
    make_demo_model(path)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_demo_model_signature(demo_session: ort.InferenceSession) -> None:
    [inp] = demo_session.get_inputs()
    [out] = demo_session.get_outputs()
    assert (inp.name, inp.type, inp.shape) == ("input", "tensor(float)", ["batch", 512])
    assert (out.name, out.type, out.shape) == ("output", "tensor(float)", ["batch", 10])


@pytest.mark.parametrize("batch", [1, 3])
def test_demo_model_outputs_are_finite_and_nontrivial(
    demo_session: ort.InferenceSession, batch: int
) -> None:
    x = np.random.default_rng(batch).standard_normal((batch, 512), dtype=np.float32)

    [y] = demo_session.run(["output"], {"input": x})

    assert y.shape == (batch, 10)
    assert y.dtype == np.float32
    assert np.isfinite(y).all()
    assert np.abs(y).max() > 1e-3
    assert np.abs(y).max() < 1e3


def test_demo_model_is_reproducible_and_sized_by_its_arguments(tmp_path: Path) -> None:
    dims = {"input_dim": 4, "hidden_dim": 8, "hidden_layers": 3, "output_dim": 2, "seed": 7}
    make_demo_model(tmp_path / "a.onnx", **dims)
    make_demo_model(tmp_path / "nested" / "b.onnx", **dims)
    make_demo_model(tmp_path / "c.onnx", **(dims | {"seed": 8}))

    a = (tmp_path / "a.onnx").read_bytes()
    assert a == (tmp_path / "nested" / "b.onnx").read_bytes()
    assert a != (tmp_path / "c.onnx").read_bytes()
    session = ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", 4]
    assert session.get_outputs()[0].shape == ["batch", 2]
    matmuls = [n for n in _op_types(tmp_path / "a.onnx") if n == "MatMul"]
    assert len(matmuls) == 4


def _op_types(path: Path) -> list[str]:
    return [node.op_type for node in onnx.load(path).graph.node]


@pytest.mark.parametrize(
    "bad", [{"input_dim": 0}, {"hidden_dim": -1}, {"output_dim": 0}, {"hidden_layers": -1}]
)
def test_demo_model_refuses_bad_dimensions(tmp_path: Path, bad: dict[str, int]) -> None:
    [(key, value)] = bad.items()
    with pytest.raises(ValueError, match=rf"{key} must be >= [01], got {value}"):
        make_demo_model(tmp_path / "bad.onnx", **bad)
    assert not (tmp_path / "bad.onnx").exists()
