"""The Markdown reports of benchmarks/sentence_embeddings.py: the students' table (with the tuned probe, its
paired difference to the untrained student and the standard errors of benchmarks/sentence_probe.py when the run
has them), the merge of other processes' seeds, and the study table of `--study` (one student, several
distillation settings, measured along the steps)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _load(values) -> str:
    return ", ".join("-" if v is None else f"{v:.1f}" for v in values) if values else "-"


def report(data: dict) -> str:
    t = data["teacher"]
    meta = data.get("meta") or {}
    lines = [f"Command: `{meta.get('command')}`, {meta.get('date')}, {meta.get('seconds', 0) / 60:.1f} min, "
             f"load average (1, 5, 15 min) before / after: {_load(meta.get('load_before'))} / "
             f"{_load(meta.get('load_after'))}.", "",
             *([f"**Partial**: {data['partial']}.", ""] if data.get("partial") else []),
             f"Machine: {data['machine']}; {data['contention']}", "",
             f"Teacher all-MiniLM-L6-v2: SST-2 probe accuracy {t['probe']:.4f} ({data['config']['probe_rows']} "
             f"training sentences, 872 validation), {t['parameters'] / 1e6:.1f} M parameters.", "",
             "| student | layers x width | params (M) | cosine to teacher (held-out) | probe acc, KD | % of teacher "
             "| probe acc, no KD (untrained student) | speed-up b1 | speed-up b32 |",
             "|---|---|---|---|---|---|---|---|---|"]
    if any("probe_tuned_kd" in r for r in data["students"].values()):
        lines[-2:] = tuned_table(data)
    for name, r in data["students"].items():
        if "probe_tuned_kd" in r:
            continue
        cos, cos_sd = r["cosine_kd"]
        acc, acc_sd = r["probe_kd"]
        no_kd, no_kd_sd = r["probe_no_kd"]
        cos0 = r.get("cosine_no_kd")
        lines.append(f"| {name} | {r['shape']} | {r['parameters'] / 1e6:.1f} | {cos:.4f} ± {cos_sd:.4f}"
                     f"{f' (no KD {cos0:.4f})' if cos0 is not None else ''} | {acc:.4f} ± {acc_sd:.4f} | "
                     f"{100 * acc / t['probe']:.1f}% | {no_kd:.4f} ± {no_kd_sd:.4f} | {r['speedup']['batch1']:.2f}x "
                     f"| {r['speedup']['batch32']:.2f}x |")
    lines += [""] if data.get("merged") else []
    for part in data.get("merged", []):
        meta = part.get("meta") or {}
        lines += [f"Measured at the same time by a separate process ({part['file']}): `{meta.get('command')}`, "
                  f"{meta.get('date')}, {meta.get('seconds', 0) / 60:.1f} min"
                  + (f"; partial: {part['partial']}" if part.get("partial") else "")
                  + f". Its students ({', '.join(part.get('students', []))}) ran the seeds of its command"
                  + (": with one seed, their ± 0.0000 is no spread." if len((part.get("config") or {}).get(
                      "seeds", [])) == 1 else ".")]
    for part in data.get("merged_seeds", []):
        meta = part.get("meta") or {}
        lines += ["", f"Other seeds run by a separate process at the same time ({part['file']}): "
                  f"`{meta.get('command')}`, {meta.get('date')}, {meta.get('seconds', 0) / 60:.1f} min; speed-ups are "
                  "the median of the processes' measurements."]
    lines += ["", f"Seeds {data['config']['seeds']} (mean ± standard deviation over them); target (issue #44): the "
              "3-layer student within 98% of the teacher's probe accuracy and >= 1.8x faster.", "",
              "No KD = the student as built, never trained: for the copied students (L3, L2) the teacher's layers "
              "copied, one model whatever the seed (its ± 0.0000 is no spread; its cosine is in brackets); for the "
              "shrunk one its seeded random initialisation. Without a teacher there is nothing to train a student on "
              "unlabeled sentences with, so this is the baseline the distillation is measured against.", ""]
    if "L3" in data["students"]:
        r = data["students"]["L3"]
        share = (r["probe_tuned_kd"][0] / t["probe_tuned"]) if "probe_tuned_kd" in r else r["probe_kd"][0] / t["probe"]
        phrases = (f"; on the {data['config']['test_phrases']:,} held-out phrases "
                   f"{100 * r['probe_phrases_kd'][0] / t['probe_phrases']:.1f}% "
                   f"({'met' if r['probe_phrases_kd'][0] >= 0.98 * t['probe_phrases'] else 'missed'})"
                   if "probe_phrases_kd" in r else "")
        lines.append(f"L3: {100 * share:.1f}% of the teacher's probe accuracy ({'met' if share >= 0.98 else 'missed'}"
                     f"{phrases}), speed-up {r['speedup']['batch1']:.2f}x / {r['speedup']['batch32']:.2f}x at batch "
                     f"1 / 32 ({', '.join(('met' if v >= 1.8 else 'missed') for v in r['speedup'].values())}).")
    lines += ["", "Config: " + json.dumps(data["config"]), ""]
    return "\n".join(lines)


def merge_seeds(data: dict, part: dict, name: str) -> None:
    """Add `part`'s seeds to `data` (same students and settings, other seeds): runs appended, means and spreads
    recomputed, speed-ups the median of the processes' measurements. Refuses other settings or a repeated seed."""
    same = {k: v for k, v in data["config"].items() if k != "seeds"}
    if same != {k: v for k, v in part["config"].items() if k != "seeds"} or set(data["config"]["seeds"]) & set(
            part["config"]["seeds"]):
        raise SystemExit(f"--merge-seeds {name}: its settings differ from this run's or it repeats a seed")
    if any("layers" not in spec for spec in data["config"]["students"].values()):
        raise SystemExit(f"--merge-seeds {name}: only copied students (whose no-KD model is seed-free) merge")
    data["config"]["seeds"] = data["config"]["seeds"] + part["config"]["seeds"]
    for key, r in data["students"].items():
        o = part["students"][key]
        r["runs"] += o["runs"]
        r["cosine_kd"] = mean_std([x["cosine"] for x in r["runs"]])
        for key_kd, key in (("probe_kd", "probe"), ("probe_tuned_kd", "probe_tuned"),
                            ("probe_phrases_kd", "probe_phrases")):
            if key_kd in r:
                r[key_kd] = mean_std([x[key] for x in r["runs"]])
        r.setdefault("speedups_per_process", [dict(r["speedup"])]).append(o["speedup"])
        r["speedup"] = {b: statistics.median(m[b] for m in r["speedups_per_process"]) for b in r["speedup"]}
    data.setdefault("merged_seeds", []).append({"file": name, "meta": part.get("meta")})


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _pct(x: float, ref: float) -> str:
    return f"{100 * x / ref:.1f}%"


def tuned_table(data: dict) -> list[str]:
    """The students' table of a run with both probes: the tuned probe first (standardised, C by cross-validation),
    the paired difference KD - no KD with its bootstrap standard error (seed 0's run, the same test sentences),
    then the fixed C=1 probe of the first runs."""
    t = data["teacher"]
    lines = [f"Teacher probe: tuned {t['probe_tuned']:.4f} (C={t['C']:g}; standard error over the 872 test "
             f"sentences {t['probe_tuned_se']:.4f}), fixed C=1 {t['probe']:.4f}.", "",
             "| student | layers x width | params (M) | cosine to teacher (held-out) | probe, KD | % of teacher | "
             "probe, no KD | KD - no KD (paired SE) | fixed-C probe KD / no KD (% of teacher) | speed-up b1 | "
             "speed-up b32 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in data["students"].items():
        if "probe_tuned_kd" not in r:
            continue
        cos, cos_sd = r["cosine_kd"]
        acc, acc_sd = r["probe_tuned_kd"]
        no_kd = r["probe_tuned_no_kd"][0]
        pair = r["runs"][0]["vs_no_kd"]
        cos0 = r.get("cosine_no_kd")
        lines.append(
            f"| {name} | {r['shape']} | {r['parameters'] / 1e6:.1f} | {cos:.4f} ± {cos_sd:.4f}"
            f"{f' (no KD {cos0:.4f})' if cos0 is not None else ''} | {acc:.4f} ± {acc_sd:.4f} | "
            f"{_pct(acc, t['probe_tuned'])} | {no_kd:.4f} | {100 * pair['diff']:+.1f} pt ({100 * pair['diff_se']:.1f}) "
            f"| {r['probe_kd'][0]:.4f} / {r['probe_no_kd'][0]:.4f} ({_pct(r['probe_kd'][0], t['probe'])}) | "
            f"{r['speedup']['batch1']:.2f}x | {r['speedup']['batch32']:.2f}x |")
    return lines + phrases_lines(data)


def phrases_lines(data: dict) -> list[str]:
    """The second test set's reading (`--test-phrases`): the tuned probe on held-out SST-2 training phrases, KD and no
    KD as shares of the teacher, with the paired standard error against the teacher (seed 0's run)."""
    t = data["teacher"]
    if "probe_phrases" not in t:
        return []
    n = data["config"]["test_phrases"]
    lines = ["", f"The same tuned probe on {n:,} held-out SST-2 training phrases (>= 10 words, sharing no 4-word run "
             f"with each other, the probe's rows or the distillation sentences): teacher {t['probe_phrases']:.4f} "
             f"(standard error {t['probe_phrases_se']:.4f}).", "",
             "| student | probe, KD | % of teacher | KD - teacher (paired SE) | probe, no KD | % of teacher | "
             "KD - no KD (paired SE) |", "|---|---|---|---|---|---|---|"]
    for name, r in data["students"].items():
        if "probe_phrases_kd" not in r:
            continue
        (acc, sd), no_kd = r["probe_phrases_kd"], r["probe_phrases_no_kd"][0]
        vt, vn = r["runs"][0]["phrases_vs_teacher"], r["runs"][0]["phrases_vs_no_kd"]
        lines.append(f"| {name} | {acc:.4f} ± {sd:.4f} | {_pct(acc, t['probe_phrases'])} | {100 * vt['diff']:+.1f} pt "
                     f"({100 * vt['diff_se']:.1f}) | {no_kd:.4f} | {_pct(no_kd, t['probe_phrases'])} | "
                     f"{100 * vn['diff']:+.1f} pt ({100 * vn['diff_se']:.1f}) |")
    return lines


def study(files: list[str]) -> str:
    """One row per run and measured step of the `--students L3 --seeds 0` runs named in `files` (each a .json of
    one distillation setting): what changes the probe, and the trend with steps."""
    rows, teacher, seen, runs = [], None, set(), []
    lines = ["| setting | steps | cosine to teacher | probe (tuned) | % of teacher | KD - no KD (paired SE) | "
             "fixed-C probe (% of teacher) |", "|---|---|---|---|---|---|---|"]
    for name in files:
        data = json.loads(Path(name).read_text())
        t, c = data["teacher"], data["config"]
        teacher = t
        setting = (f"{c['embedding_loss']}, lr {c['lr']:g}{', embeddings frozen' if c.get('freeze_embeddings') else ''}"
                   f", {c['sst2_sentences'] + c['wiki_sentences']:,} sentences, seed {c['seeds'][0]}")
        meta = data.get("meta") or {}
        runs.append(f"- `{meta.get('command')}`: {meta.get('date')}, {meta.get('seconds', 0) / 60:.1f} min, load "
                    f"average before / after {_load(meta.get('load_before'))} / {_load(meta.get('load_after'))}.")
        for student, no_kd in data.get("no_kd_only", {}).items():  # --no-kd-only runs: the copies as built
            seen.add(student)
            rows.append(f"| {student} no KD (layers {c['students'][student].get('layers')} copied) | 0 | "
                        f"{no_kd[0]['cosine']:.4f} | {no_kd[0]['probe_tuned']:.4f} | "
                        f"{_pct(no_kd[0]['probe_tuned'], t['probe_tuned'])} | | {no_kd[0]['probe']:.4f} "
                        f"({_pct(no_kd[0]['probe'], t['probe'])}) |")
        for student, r in data["students"].items():
            base = r["no_kd_runs"][0]
            if student not in seen:
                seen.add(student)
                what = f"layers {c['students'][student]['layers']} copied" if "layers" in c["students"][student] else \
                    "random, as built"
                rows.append(f"| {student} no KD ({what}) | 0 | "
                            f"{_num(base['cosine'])} | "
                            f"{base['probe_tuned']:.4f} | {_pct(base['probe_tuned'], t['probe_tuned'])} | | "
                            f"{base['probe']:.4f} ({_pct(base['probe'], t['probe'])}) |")
            for point in [*r["runs"][0].get("trend", []), {**r["runs"][0], "step": r["runs"][0]["steps"]}]:
                pair = point["vs_no_kd"]
                rows.append(f"| {student} {setting} | {point['step']} | {point['cosine']:.4f} | "
                            f"{point['probe_tuned']:.4f} | {_pct(point['probe_tuned'], t['probe_tuned'])} | "
                            f"{100 * pair['diff']:+.1f} pt ({100 * pair['diff_se']:.1f}) | {point['probe']:.4f} "
                            f"({_pct(point['probe'], t['probe'])}) |")
    head = [f"Teacher: tuned probe {teacher['probe_tuned']:.4f} (C={teacher['C']:g}, standard error "
            f"{teacher['probe_tuned_se']:.4f} over the 872 test sentences), fixed C=1 probe {teacher['probe']:.4f}.",
            ""] if teacher else []
    return "\n".join(head + lines + rows + ["", "Runs (one process each, 1 torch thread, `nice -n 19`):", *runs]) + "\n"
