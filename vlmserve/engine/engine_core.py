"""The inner loop: schedule -> execute -> update, over one scheduler and one runner."""

from __future__ import annotations

import logging

from vlmserve.core.scheduler import EngineCoreOutput, Scheduler
from vlmserve.request import FinishReason, Request, RequestStatus
from vlmserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    def reset_caches(self) -> None:
        """Forgets the prefix and encoder caches (the engine must be idle)."""
        self.scheduler.reset_caches()
        self.runner.clear_encoder_cache()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except Exception as e:
            # a fault in the model fails the requests of this step, not the engine
            logger.exception("model execution failed")
            ids = list(scheduler_output.num_scheduled_tokens)
            self.scheduler.discard_step(scheduler_output)
            return [
                EngineCoreOutput(rid, [], FinishReason.ERROR, error=f"internal error: {type(e).__name__}: {e}")
                for rid in ids
            ]
        self.num_steps += 1
        return self.scheduler.update_from_output(scheduler_output, runner_output)
