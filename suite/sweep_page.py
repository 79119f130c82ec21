"""The sampling sweep as one self-contained HTML page, for a person to judge.

One table per prompt, one row per grid point: the parameters, the output, its length in
tokens, distinct-1, distinct-2 and rep-3 (suite/sweep.py), and a radio button to mark the best
output of the prompt. A small inline script shows the marks as JSON and downloads them
(``sweep-choices.json``): the page loads nothing from anywhere, so it opens from a file or a
mail attachment alike. Every text from the model or the prompts file is escaped.
"""

from __future__ import annotations

from html import escape

from suite.sweep import Cell, Prompt, SweepResults

LOOP_REP_3 = 0.3
"""rep-3 above which an output is shaded as looping (a third of its 3-grams seen before)."""

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; }
table { border-collapse: collapse; margin-bottom: 2em; width: 100%; }
th, td { border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; text-align: left; }
td.out { white-space: pre-wrap; max-width: 60em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.loop td.out { background: #fff1e6; }
td.error { color: #a00; }
pre#choices { background: #f4f4f4; padding: 0.5em; }
"""

_SCRIPT = """
(function () {
  var total = document.querySelectorAll('table.prompt').length;
  function choices() {
    var out = {};
    document.querySelectorAll('input.best:checked').forEach(function (r) { out[r.dataset.prompt] = r.value; });
    return out;
  }
  function show() {
    var c = choices();
    document.getElementById('choices').textContent = JSON.stringify(c, null, 1);
    document.getElementById('marked').textContent = Object.keys(c).length + ' of ' + total + ' prompts marked';
  }
  document.addEventListener('change', show);
  document.getElementById('export').addEventListener('click', function () {
    var body = document.body.dataset;
    var doc = {grid: body.grid, seed: Number(body.seed), best: choices()};
    var blob = new Blob([JSON.stringify(doc, null, 1)], {type: 'application/json'});
    var a = document.createElement('a');
    a.href = URL.createObjectURL(blob);
    a.download = 'sweep-choices.json';
    document.body.appendChild(a);
    a.click();
    a.remove();
    URL.revokeObjectURL(a.href);
  });
  show();
})();
"""


def _row(prompt: Prompt, point: str, cell: Cell | None) -> str:
    """One grid point's row of a prompt's table."""
    params = "".join(f"<td>{escape(term.partition('=')[2])}</td>" for term in point.split())
    attrs = f'data-prompt="{escape(prompt.id)}" data-point="{escape(point)}"'
    radio = (f'<td><input type="radio" class="best" name="best-{escape(prompt.id)}" '
             f'data-prompt="{escape(prompt.id)}" value="{escape(point)}"></td>')
    if cell is None or cell.error:
        why = "missing from the results" if cell is None else cell.error
        blanks = "<td></td>" * 4
        return f'<tr>{params}<td class="out error" {attrs}>error: {escape(why)}</td>{blanks}{radio}</tr>'
    figures = "".join(f'<td class="num">{value}</td>' for value in
                      (cell.num_tokens, f"{cell.distinct_1:.2f}", f"{cell.distinct_2:.2f}", f"{cell.rep_3:.2f}"))
    shade = ' class="loop"' if cell.rep_3 > LOOP_REP_3 else ""
    return f'<tr{shade}>{params}<td class="out" {attrs}>{escape(cell.text)}</td>{figures}{radio}</tr>'


def _table(results: SweepResults, prompt: Prompt) -> str:
    """A prompt's heading and its table, one row per grid point."""
    keys = "".join(f"<th>{escape(term.partition('=')[0])}</th>" for term in results.points[0].split())
    figures = "".join(f"<th>{name}</th>" for name in ("output", "tokens", "distinct-1", "distinct-2", "rep-3", "best"))
    head = f"<tr>{keys}{figures}</tr>"
    rows = "\n".join(_row(prompt, point, results.cell(prompt.id, point)) for point in results.points)
    kind = f" ({escape(prompt.kind)})" if prompt.kind else ""
    return (f'<h2 id="prompt-{escape(prompt.id)}">{escape(prompt.id)}{kind}</h2>\n'
            f'<p class="prompt">{escape(prompt.text)}</p>\n'
            f'<table class="prompt" data-prompt="{escape(prompt.id)}">\n{head}\n{rows}\n</table>')


def render_page(results: SweepResults) -> str:
    """The whole page for ``results``."""
    model = escape(results.model or "the default route")
    tables = "\n".join(_table(results, prompt) for prompt in results.prompts)
    run = "; ".join(f"{escape(key)} {escape(value)}" for key, value in results.meta.items())
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>aiserve sampling sweep</title>
<style>{_STYLE}</style>
</head>
<body data-grid="{escape(results.grid)}" data-seed="{results.seed}">
<h1>Sampling sweep</h1>
<p>Model: {model}. Grid: <code>{escape(results.grid)}</code>. Seed {results.seed},
at most {results.max_new_tokens} new tokens per output, cache bypassed.
distinct-n = distinct n-grams / n-grams of the output's tokens; rep-3 = share of its 3-grams
that repeat an earlier one (shaded above {LOOP_REP_3}).{f" Run: {run}." if run else ""}</p>
<p>Mark the best output of each prompt, then <button id="export" type="button">download the marks</button>
(<span id="marked"></span>).</p>
<pre id="choices"></pre>
{tables}
<script>{_SCRIPT}</script>
</body>
</html>
"""
