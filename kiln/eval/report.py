"""A run's report: one self-contained HTML page (no scripts, no external assets) with each
criterion's pass rate and score distribution, and every item with its sample and results."""

from __future__ import annotations

import json

import jinja2

BINS = 10

_TEMPLATE = jinja2.Environment(autoescape=True).from_string("""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>{{ ev.name or ev.id }}: {{ run.name }}</title>
<style>
 body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2330; }
 h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
 .meta { color: #5b6475; } .cards { display: flex; gap: 12px; flex-wrap: wrap; }
 .card { border: 1px solid #d8dce4; border-radius: 6px; padding: 10px 14px; min-width: 220px; }
 .bar { background: #eef0f4; height: 14px; border-radius: 3px; overflow: hidden; }
 .bar > span { display: block; height: 100%; background: #2f7d4f; }
 .hist { display: flex; align-items: flex-end; gap: 2px; height: 60px; margin-top: 8px; }
 .hist > span { flex: 1; background: #4a6fa5; min-height: 1px; }
 table { border-collapse: collapse; width: 100%; } td, th { border-top: 1px solid #e3e6ec; padding: 6px;
 text-align: left; vertical-align: top; } pre { margin: 0; white-space: pre-wrap; max-width: 520px; }
 .pass { color: #2f7d4f; } .fail { color: #b3261e; } .errored { color: #8a5a00; }
</style></head><body>
<h1>{{ ev.name or ev.id }}</h1>
<div class="meta">run {{ run.name }} ({{ run.id }}) · model {{ run.model or "(given samples)" }} · {{ run.status }} ·
 {{ counts.total }} items: {{ counts.passed }} passed, {{ counts.failed }} failed, {{ counts.errored }} errored</div>
<h2>Criteria</h2>
<div class="cards">
{% for c in criteria %}<div class="card" data-criterion="{{ c.name }}"><b>{{ c.name }}</b>
 <div>pass rate {{ "%.1f" | format(100 * c.rate) }}% ({{ c.passed }} of {{ c.graded }}) · mean score
 {{ "%.3f" | format(c.mean) if c.mean is not none else "n/a" }}</div>
 <div class="bar"><span style="width: {{ "%.1f" | format(100 * c.rate) }}%"></span></div>
 <div class="hist" title="scores from {{ c.lo }} to {{ c.hi }}">{% for h in c.hist %}<span
  style="height: {{ h }}%"></span>{% endfor %}</div>
 <div class="meta">score distribution, {{ c.lo }} to {{ c.hi }}</div></div>
{% endfor %}</div>
<h2>Items</h2>
<table><tr><th>#</th><th>status</th><th>item</th><th>sample</th><th>results</th></tr>
{% for o in outcomes %}<tr class="item"><td>{{ o.datasource_item_id }}</td>
 <td class="{{ o.status }}">{{ o.status }}</td><td><pre>{{ o.item_text }}</pre></td><td><pre>{{ o.output }}</pre></td>
 <td>{% for r in o.results %}<div class="{{ "pass" if r.passed else "fail" }}">{{ r.name }}:
 {{ "%.3f" | format(r.score) if r.score is not none else "n/a" }}</div>{% endfor %}</td></tr>
{% endfor %}</table></body></html>
""")


def _criterion(name: str, outcomes: list[dict]) -> dict:
    results = [r for o in outcomes for r in o.get("results", []) if r.get("name") == name]
    scores = [float(r["score"]) for r in results if isinstance(r.get("score"), int | float)]
    passed = sum(bool(r.get("passed")) for r in results)
    lo, hi = (min(scores + [0.0]), max(scores + [1.0]))
    counts = [0] * BINS
    for s in scores:
        counts[min(BINS - 1, int((s - lo) / ((hi - lo) or 1.0) * BINS))] += 1
    top = max(counts) or 1
    return {"name": name, "passed": passed, "graded": len(results), "rate": passed / max(1, len(results)),
            "mean": sum(scores) / len(scores) if scores else None, "lo": round(lo, 3), "hi": round(hi, 3),
            "hist": [round(100 * c / top, 1) for c in counts]}


def _output_text(sample: dict | None) -> str:
    if not sample:
        return ""
    if sample.get("error"):
        return f"error: {sample['error'].get('message', '')}"
    return "".join(m.get("content") or "" for m in sample.get("output") or [])


def render_report(ev: dict, run: dict, outcomes: list[dict]) -> str:
    criteria = [_criterion(c["name"], outcomes) for c in ev.get("testing_criteria", [])]
    rows = [{**o, "item_text": json.dumps(o.get("datasource_item"), ensure_ascii=False, indent=1),
             "output": _output_text(o.get("sample"))} for o in sorted(outcomes, key=lambda o: o["datasource_item_id"])]
    return _TEMPLATE.render(ev=ev, run=run, counts=run["result_counts"], criteria=criteria, outcomes=rows)
