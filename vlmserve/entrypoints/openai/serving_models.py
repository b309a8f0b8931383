"""The models a server answers to: the base model, and the LoRA adapters loaded under
names of their own (`--lora-modules name=path`, or at run time through
`/v1/load_lora_adapter` where allowed). A request picks one by its "model" field, as
with vLLM; /v1/models lists the adapters with the base model as their parent."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from pathlib import Path
from typing import Any

from vlmserve.engine.protocol import EngineClient
from vlmserve.entrypoints.openai.protocol import OpenAIError
from vlmserve.errors import ConfigError
from vlmserve.lora.request import LoRARequest


def adapters_from_args(args: Any) -> dict[str, str]:
    """The adapters named on the command line; LoRA is turned on where any may be served."""
    modules = dict(args.lora_modules)
    if len(modules) != len(args.lora_modules):
        raise ConfigError("--lora-modules: a name is given twice")
    if modules or args.allow_runtime_lora_updating:
        args.enable_lora = True
    return modules


MAX_ADAPTER_NAME_CHARS = 256


class ServedModels:
    def __init__(self, engine: EngineClient, base_name: str, allowed_lora_path: str | None = None) -> None:
        """allowed_lora_path: the folder adapters loaded at run time must lie under (None:
        anywhere the server can read)."""
        self.engine = engine
        self.base_name = base_name
        self.allowed_lora_path = allowed_lora_path
        self.adapters: dict[str, LoRARequest] = {}
        self.created = int(time.time())
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """An adapter under a name (a new id, so nothing cached under an earlier adapter of
        the same name is reused); LoRAError (a ValueError) if the engine cannot serve it."""
        if name == self.base_name or name in self.adapters:
            raise ValueError(f"the name {name!r} is already in use")
        if len(name) > MAX_ADAPTER_NAME_CHARS or not name.isprintable():
            raise ValueError(f"an adapter's name is printable text of at most {MAX_ADAPTER_NAME_CHARS} characters")
        lora = LoRARequest(name, next(self._ids), path)
        try:
            self.engine.check_lora(lora)
        except OSError as e:  # a path the system refuses (too long, unreadable)
            raise ValueError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
        self.adapters[name] = lora
        return lora

    def _check_allowed(self, path: str) -> None:
        if self.allowed_lora_path is None:
            return
        try:
            real = Path(path).expanduser().resolve()
        except (OSError, ValueError):
            raise OpenAIError(400, "lora_path is not a usable path", param="lora_path") from None
        root = Path(self.allowed_lora_path).expanduser().resolve()
        if real != root and root not in real.parents:
            raise OpenAIError(400, f"lora_path {path!r} is outside the folder adapters may be loaded from "
                                   f"(--allowed-lora-path)", param="lora_path", code="invalid_lora")

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's "model" names (None: the base model); 404 if unknown."""
        if model is None or model == self.base_name:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            names = ", ".join(repr(n) for n in [self.base_name, *self.adapters])
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves {names}",
                              param="model", code="model_not_found")
        return lora

    def name_of(self, lora: LoRARequest | None) -> str:
        return self.base_name if lora is None else lora.lora_name

    def cards(self) -> list[dict[str, Any]]:
        """/v1/models' entries, with vLLM's fields (root: the folder; parent: the base model)."""
        permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": self.created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        base = {"id": self.base_name, "object": "model", "created": self.created, "owned_by": "vlmserve",
                "root": self.engine.model_path, "parent": None, "max_model_len": self.engine.max_model_len,
                "permission": [permission]}
        return [base] + [{**base, "id": lora.lora_name, "root": lora.lora_path, "parent": self.base_name}
                         for lora in self.adapters.values()]

    # -- run-time loading (vLLM's routes and bodies) ----------------------------------------------
    async def load(self, name: str, path: str) -> str:
        if not name or not path:
            raise OpenAIError(400, "both 'lora_name' and 'lora_path' must be given, as strings")
        if name in self.adapters:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", code="invalid_lora")
        self._check_allowed(path)
        try:  # reads and checks the adapter's config and tensors: off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self.add, name, path)
        except ValueError as e:
            raise OpenAIError(400, str(e), code="invalid_lora") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        """Requests already running under it finish under it; later ones cannot name it."""
        if name not in self.adapters:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                              code="lora_not_found")
        del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."
