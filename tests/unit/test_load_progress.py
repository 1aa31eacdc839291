"""A loading server's progress comes from its own log lines: the latest of loading model,
loading weights x/y, compiled step shape x/y and warmup; other lines leave it alone; the
handler listens only while attached."""

from __future__ import annotations

import logging

from pdtopo.runtime.api.load_progress import LoadProgress, progress_text


def test_progress_text_of_each_load_step():
    assert progress_text("loading model tiny-llama ...") == "loading model"
    assert progress_text("loading weights: 30/272 tensors (1.2s)") == \
        "loading weights 30/272 tensors"
    assert progress_text("model loaded (512 KV pages x 16 tokens); warming up ...") == \
        "warming up"
    assert progress_text("compiled step shape 3/16 flat/64/32 in 0.71s") == \
        "compiled step shape 3/16"
    assert progress_text("warmup: 16 step shapes compiled, 2 run, in 11.4s") == \
        "running warmup steps"
    assert progress_text("warmed KV scatter 2/4 (16 wire rows) in 0.15s") == \
        "compiled KV scatter 2/4"
    assert progress_text("mesh tp=1 on ['TFRT_CPU_0']") is None


def test_handler_keeps_the_latest_while_attached():
    progress = LoadProgress().attach()
    root = logging.getLogger("pdtopo")
    old = root.level
    root.setLevel(logging.INFO)
    log = logging.getLogger("pdtopo.runtime.model.loader")
    try:
        assert progress.latest() == "starting"
        log.info("loading weights: %d/%d tensors (%.1fs)", 5, 10, 0.5)
        log.info("an unrelated line")
        assert progress.latest() == "loading weights 5/10 tensors"
        logging.getLogger("pdtopo.runtime.engine.model_runner").info(
            "compiled step shape %d/%d %s in %.2fs", 2, 6, "decode/2/2", 0.7)
        assert progress.latest() == "compiled step shape 2/6"
        progress.detach()
        log.info("loading weights: %d/%d tensors (%.1fs)", 9, 10, 0.9)
        assert progress.latest() == "compiled step shape 2/6"
    finally:
        progress.detach()
        root.setLevel(old)
