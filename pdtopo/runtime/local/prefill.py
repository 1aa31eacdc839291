"""Prefill engine of a local-disaggregation process: `LocalPrefillMixin` (+ `LocalEngineMixin`).

The engine is the ordinary scheduler on the prefill mesh; its thread owns the prefill pool.
Per request:

    handle_new_request   -> register the rid on the process's RequestBoard (duplicates are
                            rejected), then the engine's normal admission
    prefill (engine)     -> on_prefill_finished(req, first_token): emit the first token like
                            any engine (a request that stops there finishes here); otherwise
                            gather the prompt pages into packed copies (select_from_kv_caches),
                            give the pages back to this pool, drop the request from this engine
                            and hand it to the transfer backlog (blocking when it is full)

From the handoff on, the request belongs to the transfer thread, then to one decode engine.
"""

from __future__ import annotations

import logging
from typing import Any

from pdtopo.kernels import select_from_kv_caches
from pdtopo.runtime.engine.request import FinishReason, Req, TokenLogprob
from pdtopo.runtime.local.engine_mixin import LocalEngineMixin
from pdtopo.runtime.local.transfer import TransferItem, put_until

log = logging.getLogger("pdtopo.local.prefill")


class LocalPrefillMixin(LocalEngineMixin):
    role = "prefill"

    def __init__(self, *args: Any, transfer_backlog, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.transfer_backlog = transfer_backlog
        self.num_handoffs = 0

    def handle_new_request(self, req: Req) -> None:
        if not self.board.register(req):  # refused without touching the live request
            self.refuse_request(req, FinishReason.duplicate(req.rid))
            return
        super().handle_new_request(req)

    def on_prefill_finished(self, req: Req, next_token: int,
                            logprob: TokenLogprob | None = None) -> None:
        if self.process_new_token(req, next_token, logprob):
            return  # finished with its first token (length 1, EOS, stop string)
        prompt_len = len(req.prompt_ids)
        packed = select_from_kv_caches(self.runner.kv_caches,
                                       req.page_ids[: self.pages_for(prompt_len)], padded=True)
        self.release_kv(req, keep=True)  # packed holds copies; full pages stay cached
        self.reqs.pop(req.rid, None)
        item = TransferItem(req=req, packed=packed, prompt_len=prompt_len,
                            source=self.engine_name)
        # its first token goes to the client before a decode engine can emit the second (the
        # engines share the request's sink; each holds its outputs until it waits: outputs.py)
        self.flush_outputs()
        if not put_until(self.transfer_backlog, item, self.stopping):
            self.finish_request(req, FinishReason.abort("server shutting down", 503))
            return
        self.num_handoffs += 1

    def local_state(self) -> dict[str, Any]:
        return {"handoffs": self.num_handoffs}
