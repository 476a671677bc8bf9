"""LiteLLM proxy callback that appends one JSON line per model call: the bench's LiteLLM recorder.

Runs inside the LiteLLM proxy (in ``.venv-litellm``, not the project's venv), which imports it by
name from its config: ``litellm_settings: {callbacks: tests.bench.litellm_logger.handler}`` with the
repository root on ``PYTHONPATH``. ``python -m tests.bench.litellm`` writes that config and starts
the proxy; the file to write comes in ``POLAR_BENCH_LITELLM_LOG`` (LiteLLM instantiates the callback
at import, with no options of its own to pass a path).

What it writes is LiteLLM's ``standard_logging_object``: the payload LiteLLM's own loggers (S3, GCS,
the generic API logger, ...) send, with the request's messages and the response LiteLLM rebuilt,
which is what a LiteLLM user recording traffic gets (LiteLLM has no local-file logger of its own). One write and flush per call on the event loop,
as the capture addon writes its records, so a record exists once its call is logged.
"""

from __future__ import annotations

import json
import os
from typing import Any

from litellm.integrations.custom_logger import CustomLogger  # type: ignore[import-not-found]
from litellm.litellm_core_utils.safe_json_dumps import safe_json_structure  # type: ignore[import-not-found]


class JsonlLogger(CustomLogger):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.file = open(os.environ["POLAR_BENCH_LITELLM_LOG"], "a", encoding="utf-8")  # noqa: SIM115 (lives as long as the proxy)

    def _write(self, kwargs: dict[str, Any]) -> None:
        # Serialised as LiteLLM's S3 and generic-API loggers do (safe_dumps): pydantic models as JSON.
        payload = safe_json_structure(kwargs.get("standard_logging_object"))  # says success or failure itself
        self.file.write(json.dumps(payload, default=str) + "\n")
        self.file.flush()

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._write(kwargs)

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._write(kwargs)


handler = JsonlLogger()
