"""Publish a trained draft as a folder ready for the Hugging Face Hub, with a model card:
`eagle3-runner publish OUT [--run RUN_ID] [--repo-id ORG/NAME] [--license ID] [--push]`.

Without --run, the newest top-level run of the experiment that trained a draft is used. A sweep's
parent run publishes its best child by the sweep's objective (or is refused, listing its
children, when none was evaluated). OUT gets
the draft's files (readable by all) and README.md: the base model, license and datasets (front
matter: model.license / data.hub_id, else what the target's README or GGUF metadata and the
data's source say), the capture ids and their convention, the vocabulary sizes, the acceptance
the runner measured (set, k, per position), the vLLM serve command and the training command. The
card names no path of this machine; the command that serves OUT here, with the runner's engine
flags, is printed and written to OUT/serve_local.sh (never uploaded). A run that evaluated a
draft trained elsewhere (eval.draft) publishes that draft; a packed draft (runner.assets.transfer)
is
refused. --push uploads OUT to
--repo-id with huggingface_hub (which needs the network and a token; nothing else here does).
OUT is written beside itself and renamed into place; an existing non-empty OUT is refused.
Options: --output-root DIR (default $EAGLE3_RUNNER_HOME, else ./outputs), --tracking-uri URI,
--experiment NAME (default eagle3).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.assets.target_facts import hub_repo_id
from runner.commands.store_options import add_store_options, parser
from runner.core.hardware_settings import VllmLaunchConfig
from runner.core.interrupts import companion
from runner.core.store import new_folder
from runner.serving.settings import draft_fields, target_flags
from runner.tracking.job_tags import COLUMNS_TAG, OBJECTIVE_TAG, RESULTS_FILE
from runner.tracking.runs import here, store_to_read


def _find_run(client: Any, experiment: str, run_id: str | None) -> Any:
    if run_id:
        return client.get_run(run_id)
    exp = client.get_experiment_by_name(experiment)
    runs = (
        client.search_runs(
            [exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=200
        )
        if exp
        else []
    )
    for run in runs:
        if "path.train" in run.data.tags and run.info.status == "FINISHED":
            return run
    return None


def best_child(children: list[Any]) -> tuple[Any, str, float] | None:
    """The finished child with a draft that scores highest on its objective column (the tags
    every job records: runner/tracking/job_tags.py), with the column and its value; None if no child
    has one."""
    scored = []
    for child in children:
        tags = child.data.tags
        if child.info.status != "FINISHED" or "path.train" not in tags:
            continue
        objective = tags.get(OBJECTIVE_TAG)
        try:
            value = json.loads(tags.get(COLUMNS_TAG, "{}")).get(objective) if objective else None
        except ValueError:
            value = None
        if isinstance(value, int | float):
            scored.append((float(value), child.info.run_id, child, objective))
    if not scored:
        return None
    value, _, child, objective = max(scored, key=lambda s: (s[0], s[1]))
    return child, objective, value


def _resolve_parent(client: Any, run: Any) -> tuple[Any | None, str]:
    """A run that trained no draft itself: a sweep's parent gives its best child; else none,
    with the reason."""
    children = client.search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'",
        max_results=1000,
    )
    if not children:
        return None, f"run {run.info.run_id} trained no draft (no path.train tag, no child runs)"
    best = best_child(children)
    if best is None:
        ids = ", ".join(c.info.run_id for c in children)
        return None, (
            f"run {run.info.run_id} is a sweep's parent and none of its children was evaluated, "
            f"so there is no best one to choose; publish one of them with --run: {ids}"
        )
    child, objective, value = best
    return child, (
        f"run {run.info.run_id} is a sweep's parent: publishing its best child "
        f"{child.info.run_id} ({objective} {value:.3f}, of {len(children)} children)"
    )


def local_serve_command(run: Any, folder: Path) -> str | None:
    """The command the evaluation served the draft with on its machine (engine flags, and on CPU
    the memory settings), pointed at the published folder; None if the run evaluated nothing."""
    try:
        manifest = Path(run.data.tags["path.evaluate"]) / "manifest.json"
        served = json.loads(manifest.read_text())["served"]
        command = served["serve_command"].replace(served["draft"], str(folder.resolve()))
    except (KeyError, OSError, ValueError):
        return None
    # A root copied or moved since: its stored records name the root they were computed in.
    root, computed_in = _roots(run, served["draft"])
    if root is not None and computed_in is not None and computed_in != root:
        command = command.replace(f"{computed_in}/", f"{root}/")
    return command


def _roots(run: Any, served_draft: str) -> tuple[Path | None, Path | None]:
    """(the root the run's records now point at, the root its evaluation was computed in), read
    from the trained draft's place in each (<root>/store/train/<key>/draft); Nones where the
    evaluation served a draft from elsewhere (eval.draft)."""
    train = run.data.tags.get("path.train")
    if not train:
        return None, None
    here = Path(train)
    tail = here.parts[-3:]  # store/train/<key>, then draft/ or epochs/<n>/
    parts = Path(served_draft).parts
    for i in range(1, len(parts) - 3):
        if parts[i : i + 3] == tail:
            return here.parents[2], Path(*parts[:i])
    return None, None


def run_results(run: Any) -> list[dict[str, Any]]:
    """The results rows the run's stages declared (its results.json:
    runner/tracking/job_tags.py)."""
    import mlflow  # the caller already has a run: mlflow is imported

    try:
        text = mlflow.artifacts.load_text(f"{run.info.artifact_uri}/{RESULTS_FILE}")
        return list(json.loads(text))
    except Exception:  # a run from before results.json, or one that evaluated nothing
        return []


# The runner's machine-specific serve command, written beside the card (it names this machine's
# paths, so it is neither in the card nor uploaded).
LOCAL_SERVE = "serve_local.sh"


def _front_matter(readme: Path) -> dict[str, Any]:
    import yaml

    try:
        text = readme.read_text()
        if text.startswith("---"):
            return yaml.safe_load(text.split("---", 2)[1]) or {}
    except (OSError, ValueError, yaml.YAMLError):
        pass
    return {}


def _gguf_license(source: str | None, gguf_file: str | None) -> str | None:
    """general.license of a "package:" source's GGUF file (the embedded default's)."""
    import importlib.util

    if not source or not source.startswith("package:") or not gguf_file:
        return None
    try:
        spec = importlib.util.find_spec(source.removeprefix("package:"))
        folder = Path(next(iter(spec.submodule_search_locations)))  # type: ignore[union-attr]
        from gguf import GGUFReader

        field = GGUFReader(str(folder / gguf_file)).fields.get("general.license")
        return bytes(field.parts[field.data[0]]).decode() if field else None
    except Exception:  # no such package or file, not a GGUF: the license is not known
        return None


def card_license(params: dict[str, str], draft_config: dict[str, Any]) -> str | None:
    """model.license, else what the target says: its folder's README front matter, its GGUF
    metadata. None if nothing says."""
    given = params.get("model.license")
    if given and given != "None":
        return given
    local = draft_config.get("eagle3_runner", {}).get("target_local_path")
    found = _front_matter(Path(local) / "README.md").get("license") if local else None
    return found or _gguf_license(params.get("model.source"), params.get("model.gguf_file"))


def card_datasets(params: dict[str, str]) -> list[str]:
    """The hub ids of the training data: data.hub_id, else data.source when it is one."""
    found = []
    for key in ("data.hub_id", "data.source"):
        hub = hub_repo_id(params.get(key))
        if hub:
            found.append(hub)
            break
    return found


def served_settings(params: dict[str, str]) -> VllmLaunchConfig:
    """The run's serving settings (hardware.vllm.attention_backend and its kin) from its MLflow
    params: the card's serve command uses the kernels and KV cache dtype it was measured with."""
    found = {}
    for name in ("attention_backend", "draft_attention_backend", "kv_cache_dtype",
                 "rejection_sample_method", "cudagraph_mode"):  # fmt: skip
        value = params.get(f"hardware.vllm.{name}")
        if value not in (None, "", "None"):
            found[name] = value
    return VllmLaunchConfig(**found)


def draft_attention(draft_config: dict[str, Any]) -> str:
    """Each draft layer's attention as the draft's config gives it to vLLM."""
    layer = draft_config.get("transformer_layer_config", {})
    types = layer.get("layer_types") or ["full_attention"] * int(layer.get("num_hidden_layers", 1))
    window = layer.get("sliding_window")
    words = {"sliding_attention": f"sliding window of {window} tokens", "full_attention": "full"}
    return ", ".join(f"layer {i}: {words.get(t, t)}" for i, t in enumerate(types))


def known(value: Any, unknown: str = "unknown") -> Any:
    """A card's fact, or `unknown` where the run or the draft does not record it (an MLflow
    param of a null setting reads "None")."""
    return unknown if value in (None, "None", "", "null") else value


def card_metadata(
    hub: str | None,
    lic: str | None,
    datasets: list[str],
    repo: str,
    model_name: str | None,
    measured: list[dict[str, Any]],
    k: int,
) -> str:
    """The card's YAML header, written by huggingface_hub's own ModelCardData: base model,
    license, datasets, tags, and a `model-index` with the acceptance length per prompt set (an
    EvalResult each), which the hub renders as the model's results."""
    from huggingface_hub import EvalResult, ModelCardData

    results = [
        EvalResult(
            task_type="text-generation",
            task_name="speculative decoding (EAGLE-3, greedy, served by vLLM)",
            dataset_type=str(r.get("set")),
            dataset_name=str(r.get("set")),
            metric_type="acceptance_length",
            metric_name=f"acceptance length (k={r.get('k', k)}, {int(r.get('prompts') or 0)} "
            "prompts)",
            metric_value=round(float(r["acceptance_length"]), 3),
        )
        for r in measured
    ]
    data = ModelCardData(
        base_model=hub or None,
        license=lic or None,
        datasets=datasets or None,
        library_name="speculators",
        tags=["speculative-decoding", "eagle3", "speculators", "vllm"],
        model_name=f"EAGLE-3 draft for {hub or model_name}" if results else None,
        eval_results=results or None,
    )
    return data.to_yaml()


def model_card(
    run: Any,
    draft_config: dict[str, Any],
    repo: str,
    results: list[dict[str, Any]] | None = None,
    license_: str | None = None,
) -> str:
    """README.md for the published folder, from the run's params, its results rows and the
    draft's own config. It names no path of this machine: the target by its hub id (or its
    name), the draft by `repo`."""
    p = run.data.params
    ours = draft_config.get("eagle3_runner", {})
    hub = hub_repo_id(ours.get("target_hub_id")) or hub_repo_id(p.get("model.hub_id"))
    target = hub or f"{p.get('model.name')} (a local model: set model.hub_id to name it)"
    k = int(p.get("eval.num_speculative_tokens", "3"))
    serve = _card_serve_command(p, hub, repo, k)
    found = results if results is not None else run_results(run)
    measured = [r for r in found if "acceptance_length" in r]
    acceptance = _card_acceptance(measured, k)
    context = measured_on(run, draft_config, found)
    lic = license_ or card_license(p, draft_config)
    datasets = card_datasets(p)
    front_yaml = card_metadata(hub, lic, datasets, repo, p.get("model.name"), measured, k)
    table = _card_facts(p, draft_config, target, found, datasets, lic)
    where = (
        ""
        if hub
        else "\nTARGET is the target model's folder or hub id (it was a local model here).\n"
    )
    chosen = chosen_epoch(run)
    epoch_note = (
        f"\nThis is the draft of epoch {chosen['epoch']} of {chosen['epochs']}, chosen by "
        f"serving: {chosen['why']}.\n"
        if chosen
        else ""
    )
    return f"""---
{front_yaml}
---

# EAGLE-3 draft for {hub or p.get("model.name")}

Trained by eagle3-runner (MLflow run `{run.info.run_id}`) with speculators
{draft_config.get("speculators_version", "?")}.

{table}

## Acceptance measured by the runner (served by vLLM, greedy)

{acceptance}

{context}
{epoch_note}
## Serve with vLLM

```bash
{serve}
```
{where}
## Limitations

{limitations(run, measured)}

## Training command (as speculators recorded it)

See `train_command.txt`.
"""


def _card_serve_command(p: Mapping[str, str], hub: str | None, repo: str, k: int) -> str:
    """The card's `vllm serve` command: the target by its hub id (TARGET when local), the
    serving settings measured, the draft by its repo id."""
    served = served_settings(p)
    spec = {
        "method": "eagle3",
        "model": repo,
        "num_speculative_tokens": k,
        **draft_fields(served, mla=False),  # the drafts this runner trains: standard attention
    }
    serve = shlex.join(
        [
            "vllm",
            "serve",
            hub or "TARGET",
            *target_flags(served),
            "--speculative-config",
            json.dumps(spec),
        ]
    )
    if p.get("model.trust_remote_code") == "True":
        serve += " --trust-remote-code"
    return serve


def _card_acceptance(measured: list[dict[str, Any]], k: int) -> str:
    """The card's acceptance table: one row per prompt set with its interval and positions (and
    the random draft's figure where one was served)."""
    with_random = any(r.get("random_acceptance_length") is not None for r in measured)
    head = "| prompts | k | acceptance length (95% interval) | per position |"
    rule = "|---|---|---|---|"
    if with_random:
        head, rule = head + " random draft |", rule + "---|"
    rows = [head, rule]
    for r in measured:
        per_pos = " / ".join(f"{v:.3f}" for v in r.get("per_position", []))
        ci = r.get("ci95")
        interval = f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else ""
        random = r.get("random_acceptance_length")
        rows.append(
            f"| {r.get('set')} ({int(r.get('prompts') or 0)} prompts) | {r.get('k', k)} | "
            f"{r['acceptance_length']:.3f}{interval} | {per_pos} |"
            + (f" {'-' if random is None else f'{random:.3f}'} |" if with_random else "")
        )
    return "\n".join(rows) if measured else "Not evaluated."


def _card_facts(
    p: Mapping[str, str],
    draft_config: dict[str, Any],
    target: str,
    found: list[dict[str, Any]],
    datasets: list[str],
    lic: str | None,
) -> str:
    """The card's table of facts: target, capture and aux layer ids, vocabulary, data, training
    (never this run's for a draft trained elsewhere), draft attention, license."""
    ours = draft_config.get("eagle3_runner", {})
    aux = known(draft_config.get("eagle_aux_hidden_state_layer_ids"))
    vocab = (
        f"{known(draft_config.get('draft_vocab_size'))} of {known(p.get('resolved.vocab_size'))}"
    )
    # A draft evaluated here but trained elsewhere (eval.draft): this run's training settings
    # are not the draft's, and its card must not say they are.
    elsewhere = known(p.get("eval.draft"), "") != ""
    kept = next((r["rows"] for r in found if "rows" in r), None)
    rows = f"{int(kept)} rows of up to {p.get('data.max_seq_len')} tokens" if kept else ""
    data = datasets[0] if datasets else known(p.get("data.name"))
    recipe = (
        f"{p.get('train.epochs')} epoch(s), lr {p.get('train.lr')}, "
        f"{p.get('train.optimizer')}, {p.get('train.ttt_steps')} TTT steps"
    )
    if elsewhere:
        data_line = "trained elsewhere: not known to this run"
        recipe = "trained elsewhere: not known to this run (see train_command.txt, if shipped)"
    else:
        data_line = f"{data} ({known(p.get('data.name'))})" + (f", {rows}" if rows else "")
    layers = ours.get("target_num_layers")
    capture = (
        f"{ours['capture_ids']}: {ours.get('layer_id_convention')}"
        if ours.get("capture_ids")
        else "unknown (the draft's config does not record them)"
    )
    return "\n".join(
        [
            "| | |",
            "|---|---|",
            f"| target | {target}" + (f" ({layers} decoder layers)" if layers else "") + " |",
            f"| capture ids | {capture} |",
            f"| aux layer ids (`eagle_aux_hidden_state_layer_ids`) | {aux} |",
            f"| draft vocabulary | {vocab} target tokens |",
            f"| data | {data_line} |",
            f"| training | {recipe} |",
            f"| draft attention | {draft_attention(draft_config)} |",
            f"| license | {lic or 'not known: set model.license or pass --license'} |",
        ]
    )


def measured_on(run: Any, draft_config: dict[str, Any], found: list[dict[str, Any]]) -> str:
    """Where and with what the figures were measured: hardware, engine and library versions,
    the serving settings, and the validation loss (from the run's results rows)."""
    p = run.data.params
    try:
        served = json.loads(
            (Path(run.data.tags["path.evaluate"]) / "manifest.json").read_text()
        ).get("served", {})
    except (KeyError, OSError, ValueError):
        served = {}
    gpus = p.get("hardware.num_gpus", "0")
    kind = p.get("hardware.gpu_kind")
    hardware = (
        f"{gpus}x {kind}" if gpus not in ("0", None) and kind not in (None, "None") else None
    ) or f"{p.get('hardware.name')} ({p.get('hardware.device')})"
    settings = ", ".join(f"{k} {v}" for k, v in (served.get("serving") or {}).items())
    val = next((r["validation_loss"] for r in found if "validation_loss" in r), None)
    lines = [
        f"Measured on {hardware}, vLLM {served.get('vllm', 'of the run')}, greedy, "
        f"speculators {draft_config.get('speculators_version', '?')}"
        + (f"; serving settings: {settings}" if settings else "")
        + (f"; validation loss {val:.3f}" if val is not None else "")
        + "."
    ]
    return "\n".join(lines)


def limitations(run: Any, measured: list[dict[str, Any]]) -> str:
    """What the card's figures do not say, and what the run itself was (a smoke test, figures
    that failed a gate and were let through)."""
    tags = run.data.tags
    out = [
        "- Acceptance lengths are for greedy decoding on the prompt sets above; other prompts, "
        "sampling temperatures and k give other figures.",
        "- The draft predicts the target it was trained on, with the capture ids above; served "
        "with another target, or other attention kernels than the serve command names, it may "
        "accept nothing without an error.",
    ]
    if not measured:
        out.append("- This draft was not evaluated by serving.")
    if tags.get("smoke_test") == "true":
        out.append(
            "- A SMOKE TEST (run.smoke_test, e.g. preset=quick): a few rows and one epoch, "
            "published with --allow-smoke-test; its figures show the pipeline works, not a "
            "useful draft."
        )
    if tags.get("gate_warnings"):
        out.append(
            f"- Its evaluation FAILED these checks, published with --allow-gate-warnings: "
            f"{tags['gate_warnings']}"
        )
    return "\n".join(out)


def chosen_epoch(run: Any) -> dict[str, Any]:
    """The evaluation's choice of epoch ({"epoch", "draft", "why", ...}), or {}."""
    try:
        manifest = Path(run.data.tags["path.evaluate"]) / "manifest.json"
        return dict(json.loads(manifest.read_text()).get("chosen_epoch") or {})
    except (KeyError, OSError, ValueError):
        return {}


def draft_folder(run: Any) -> Path:
    """The run's draft: the one it trained, else the one its evaluation served (eval.draft)."""
    tags = run.data.tags
    if "path.train" in tags:
        # The epoch its evaluation chose by serving (eval.choose_epoch), else the last.
        return Path(tags["path.train"]) / chosen_epoch(run).get("draft", "draft")
    try:
        manifest = Path(tags["path.evaluate"]) / "manifest.json"
        return Path(json.loads(manifest.read_text())["served"]["draft"])
    except (KeyError, OSError, ValueError):
        raise FileNotFoundError(f"run {run.info.run_id} has no draft") from None


def _scrub_paths(folder: Path, run: Any, config: dict[str, Any]) -> None:
    """No path of this machine in a file that is uploaded: the output root and the target's
    local folder in train_command.txt become $OUTPUT_ROOT and the target's hub id (or
    $TARGET), and config.json keeps no target_local_path. (speculators' verifier path is the
    hub id when model.hub_id names one; a local target's stays, as the card says.)"""
    ours = config.get("eagle3_runner", {})
    hub = hub_repo_id(ours.get("target_hub_id"))
    swaps = {}
    if ours.get("target_local_path"):
        swaps[str(ours["target_local_path"])] = hub or "$TARGET"
    if "path.train" in run.data.tags:
        swaps[str(Path(run.data.tags["path.train"]).parents[2])] = "$OUTPUT_ROOT"
    command = folder / "train_command.txt"
    if command.is_file() and swaps:
        text = command.read_text()
        for local_path, name in sorted(swaps.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(local_path, name)
        command.write_text(text)
    if "target_local_path" in ours:
        del ours["target_local_path"]
        (folder / "config.json").write_text(json.dumps(config, indent=2))


def publish(
    run: Any,
    out: Path,
    repo: str | None,
    license_: str | None = None,
    allow_smoke_test: bool = False,
    allow_gate_warnings: bool = False,
    root: Path | None = None,
) -> tuple[Path, str | None]:
    """The draft as a hub folder with its card; returns it and the command that serves it on
    this machine (also written to serve_local.sh beside the card), if the run evaluated it. A
    smoke test's draft, or one whose figures failed a gate that was set to warn, is refused
    unless allowed (the card then says so)."""
    from runner.assets.transfer import packed_reason, refuse_links_out

    tags = run.data.tags
    if tags.get("smoke_test") == "true" and not allow_smoke_test:
        raise ValueError(
            f"run {run.info.run_id} is a smoke test (run.smoke_test, e.g. preset=quick): its "
            "draft shows the pipeline works, not a draft to serve; pass --allow-smoke-test to "
            "publish it anyway (the card says so)"
        )
    if tags.get("gate_warnings") and not allow_gate_warnings:
        raise ValueError(
            f"run {run.info.run_id}'s evaluation failed its gates (let through by "
            f"eval.gates=warn): {tags['gate_warnings'][:300]}; pass --allow-gate-warnings to "
            "publish it anyway (the card says so)"
        )

    draft = draft_folder(run) if root is None else here(draft_folder(run), root)
    if not (draft / "config.json").is_file():
        raise FileNotFoundError(f"no draft in {draft} (run {run.info.run_id})")
    reason = packed_reason(draft)
    if reason:
        raise ValueError(reason)
    refuse_links_out(draft)
    local = local_serve_command(run, out)
    with new_folder(out) as tmp:
        shutil.copytree(draft, tmp, dirs_exist_ok=True)
        config = json.loads((tmp / "config.json").read_text())
        repo_ref = repo or f"./{out.name}"
        (tmp / "README.md").write_text(model_card(run, config, repo_ref, license_=license_))
        _scrub_paths(tmp, run, config)
        if local:
            (tmp / LOCAL_SERVE).write_text(
                "#!/bin/sh\n# Serves this folder on the machine that evaluated it, with the "
                "runner's engine flags\n# (not uploaded: it names this machine's paths).\n"
                f"{local}\n"
            )
            (tmp / LOCAL_SERVE).chmod(0o755)
    return out, local


def main(argv: list[str] | None = None) -> int:
    ap = parser("publish", __doc__)
    ap.add_argument("out", help="the folder to write (must not exist, or be empty)")
    ap.add_argument("--run", help="MLflow run id (default: the newest run that trained a draft)")
    ap.add_argument("--repo-id", help="hub repository id, used in the card's serve command")
    ap.add_argument("--push", action="store_true", help="upload the folder to --repo-id")
    ap.add_argument(
        "--license", help="the card's license (default: model.license, else the target's)"
    )
    ap.add_argument(
        "--allow-smoke-test",
        action="store_true",
        help="publish a smoke test's draft (preset=quick); the card says what it is",
    )
    ap.add_argument(
        "--allow-gate-warnings",
        action="store_true",
        help="publish a draft whose evaluation failed a gate set to warn (eval.gates=warn)",
    )
    add_store_options(ap)
    args = ap.parse_args(argv)
    if args.push and not args.repo_id:
        ap.error("--push needs --repo-id")
    if args.repo_id:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(args.repo_id)
        except HFValidationError as exc:
            ap.error(f"--repo-id {args.repo_id!r}: {exc}")
    return companion("publish", lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    root = Path(args.output_root).expanduser().resolve()
    uri, problem = store_to_read(args.tracking_uri, root)
    if problem:  # --output-root or --tracking-uri names no store this command can read
        print(f"publish: {problem}", file=sys.stderr)
        return 2
    # (its bar for the one small results file it downloads would be most of the output)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow  # seconds to import; after the cheap checks
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(uri)
    try:
        run = _find_run(client, args.experiment, args.run)
    except MlflowException:
        print(f"publish: no run {args.run} in {uri}", file=sys.stderr)
        return 2
    if run is None:
        print(f"no finished run with a trained draft in {uri}", file=sys.stderr)
        return 1
    if not {"path.train", "path.evaluate"} & set(run.data.tags):
        run, why = _resolve_parent(client, run)
        print(why, file=sys.stderr if run is None else sys.stdout)
        if run is None:
            return 1
    try:
        out, local = publish(
            run,
            Path(args.out),
            args.repo_id,
            args.license,
            allow_smoke_test=args.allow_smoke_test,
            allow_gate_warnings=args.allow_gate_warnings,
            root=root,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"publish: {exc}", file=sys.stderr)
        return 1
    print(f"published the draft of run {run.info.run_id} to {out} (model card: {out}/README.md)")
    if not _front_matter(out / "README.md").get("license"):
        print("publish: the card names no license: set model.license or pass --license")
    if local:
        print(f"serve it here ({out / LOCAL_SERVE}):\n  {local}")
    if args.push:
        from huggingface_hub import HfApi

        HfApi().upload_folder(
            folder_path=str(out),
            repo_id=args.repo_id,
            repo_type="model",
            ignore_patterns=[LOCAL_SERVE],
        )
        print(f"uploaded to https://huggingface.co/{args.repo_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
