"""The train stage's export: the trained checkpoint copied to a draft folder vLLM serves (the
layer-id convention recorded in its config), and the export check on it before anything is
published (stages/train/draft_check.py for the folder's files, one validation pass through
speculators for its accuracy against training's own)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from runner.assets.target_facts import target_hub_id
from runner.core.errors import StageError
from runner.engine.stage import StageContext
from runner.integrations.speculators import validate_export
from runner.integrations.speculators_checkpoints import RESUME_ONLY
from runner.integrations.speculators_metrics import best_val, fix_recorded_versions
from runner.integrations.vllm import servable_draft_config
from stages.train.draft_check import Expected, check_draft

log = logging.getLogger("runner")


# Validation accuracy of the reloaded draft may differ from training's by the bf16 rounding of
# the saved weights; a broken export (wrong head, mapping or layers) drops it to near zero.
EXPORT_ACC_TOLERANCE = 0.05


def check_export(
    ctx: StageContext, settings: dict[str, Any], draft: Path, records: list, online: bool
) -> dict[str, Any]:
    """The export check (stages/train/draft_check.py) on the published draft folder, then
    speculators' validation pass over it, reloaded, against training's own validation of that
    epoch. Any problem fails the stage before the draft is published or served."""
    t = ctx.cfg.train
    expect = Expected(
        draft_vocab_size=ctx.cfg.vocab.draft_vocab_size,
        target_vocab_size=ctx.facts.vocab_size,
        hidden_size=ctx.facts.hidden_size,
        num_layers=t.num_layers,
        sliding_window=t.sliding_window,
        full_attention_layers=list(t.full_attention_layers),
        aux_layers=list(ctx.facts.aux_layers),
        capture_ids=list(ctx.facts.capture_ids),
    )
    report = check_draft(draft, ctx.inputs["vocab"].path, expect)
    metrics = dict(report.metrics)
    trained = best_val(records).get("full_acc_0_epoch")
    if not report.problems and not online and trained is not None:
        # (Online, the states came from a server that is gone: nothing stored to validate on.)
        where = ctx.scratch / "export_check"
        again = validate_export(
            settings, ctx.facts.train_slots, draft, where, ctx.cfg.hardware.device
        ).get("full_acc_0_epoch")
        if again is not None:
            metrics.update(export_full_acc_0=again, trained_full_acc_0=trained)
            report.lines.append(
                f"reloaded draft's step-0 validation accuracy {again:.3f}, training's {trained:.3f}"
            )
            if again < trained - EXPORT_ACC_TOLERANCE:
                report.problems.append(
                    f"the reloaded draft's step-0 validation accuracy {again:.3f} is below "
                    f"training's {trained:.3f} by more than {EXPORT_ACC_TOLERANCE}"
                )
    ctx.manifest["export_check"] = {"lines": report.lines, "problems": report.problems}
    if not report.problems:  # one line: the details are in the manifest
        log.info(
            "[train] export check passed: head, d2t/t2d = the vocab stage's, layer types, "
            "capture ids%s",
            f"; reloaded step-0 accuracy {metrics['export_full_acc_0']:.3f} (training "
            f"{metrics['trained_full_acc_0']:.3f})"
            if "export_full_acc_0" in metrics
            else "",
        )
    if report.problems:
        raise StageError(
            f"the exported draft in {draft} fails its check (nothing is published): "
            + "; ".join(report.problems)
        )
    return metrics


def publish_draft(ckpt: Path, draft: Path, ctx: StageContext) -> Path:
    """A checkpoint's weights and config (not its optimizer and scheduler states, which are for
    resuming) copied to `draft`, with the layer-id convention recorded in its config."""
    draft.mkdir(parents=True)
    for f in ckpt.iterdir():
        if f.is_file() and not f.name.endswith(RESUME_ONLY):
            shutil.copy2(f, draft / f.name)
    fix_recorded_versions(draft / "train_command.txt")
    # Record the layer-id convention in the draft's own config, beside speculators' fields.
    conf_path = draft / "config.json"
    conf = json.loads(conf_path.read_text())
    hub = target_hub_id(ctx.cfg)
    verifier = conf.get("speculators_config", {}).get("verifier", {})
    if hub and verifier:
        # A local path would tie the draft to this machine; the hub id loads anywhere.
        verifier["name_or_path"] = hub
    conf["eagle3_runner"] = {
        "layer_id_convention": (
            "vllm (id k = input of decoder layer k; n = final layer before norm)"
        ),
        "aux_layer_ids": list(ctx.facts.aux_layers),
        "capture_ids": list(ctx.facts.capture_ids),
        "target_num_layers": ctx.facts.num_layers,
        "target_hub_id": hub,
        "target_local_path": ctx.facts.path,
    }
    # vLLM sizes the draft's fc layer from a count speculators does not write (3 if absent).
    conf_path.write_text(json.dumps(servable_draft_config(conf), indent=2))
    for f in draft.iterdir():
        if f.is_file():
            f.chmod(0o644)  # safetensors and speculators write 0600: a draft is shared
    return draft
