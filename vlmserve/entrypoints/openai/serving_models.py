"""The models a server answers to: the base model, and the LoRA adapters loaded under
names of their own (`--lora-modules name=path`, or at run time through
`/v1/load_lora_adapter` where allowed). A request picks one by its "model" field, as
with vLLM; /v1/models lists the adapters with the base model as their parent."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
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


class ServedModels:
    def __init__(self, engine: EngineClient, base_name: str) -> None:
        self.engine = engine
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}
        self.created = int(time.time())
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """An adapter under a name (a new id, so nothing cached under an earlier adapter of
        the same name is reused); LoRAError (a ValueError) if the engine cannot serve it."""
        if name == self.base_name or name in self.adapters:
            raise ValueError(f"the name {name!r} is already in use")
        lora = LoRARequest(name, next(self._ids), path)
        self.engine.check_lora(lora)
        self.adapters[name] = lora
        return lora

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
    async def load(self, body: dict[str, Any]) -> str:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise OpenAIError(400, "both 'lora_name' and 'lora_path' must be given, as strings")
        if name in self.adapters:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", code="invalid_lora")
        try:  # reads the adapter's config and tensor shapes: off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self.add, name, path)
        except ValueError as e:
            raise OpenAIError(400, str(e), code="invalid_lora") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: dict[str, Any]) -> str:
        """Requests already running under it finish under it; later ones cannot name it."""
        name = body.get("lora_name")
        if name not in self.adapters:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                              code="lora_not_found")
        del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."
