"""The test package. Imported before conftest, so before anything imports onnxruntime:
no test run writes ONNX Runtime's device id or sends its telemetry (see
laneserve/server/__init__.py)."""

import os

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
