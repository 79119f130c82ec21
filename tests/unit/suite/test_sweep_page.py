"""The sweep page (suite/sweep_page.py) rendered by a real headless browser: Debian's chromium
loads the page, runs its script, and the DOM it dumps holds every output with its exact text
(tests/browser.py). Two pages: the shipped sweep (docs/sweep/sweep.json, written by ``aiserve
sweep`` against the real suite) and one made of hostile texts (markup, quotes, Chinese, line
breaks), which must come through as text and never as markup. Then a judge's marks are clicked
in the browser and the JSON the download button hands over is read back."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

from suite.sweep import Cell, Prompt, SweepResults, parse_grid
from suite.sweep_page import render_page
from tests.browser import Browser, dump_dom

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "docs" / "sweep" / "sweep.json"


class _Dom(HTMLParser):
    """The output cells (``td.out``) of a dumped DOM by (prompt, point), and its script count."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.cells: dict[tuple[str, str], str] = {}
        self.scripts = 0
        self.by_id: dict[str, str] = {}
        self._open: tuple[str, ...] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.scripts += tag == "script"
        if tag == "td" and "out" in (a.get("class") or "").split():
            self._open = ("cell", a.get("data-prompt") or "", a.get("data-point") or "")
        elif tag in ("pre", "span") and a.get("id"):
            self._open = ("id", a["id"] or "")
        else:
            return
        self._text = []

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._open is None or tag not in ("td", "pre", "span"):
            return
        if self._open[0] == "cell":
            self.cells[(self._open[1], self._open[2])] = "".join(self._text)
        else:
            self.by_id[self._open[1]] = "".join(self._text)
        self._open = None


def browser_dom(page: str, tmp_path: Path) -> _Dom:
    """The DOM chromium builds from ``page`` after its scripts ran, parsed."""
    path = tmp_path / "sweep.html"
    path.write_text(page, encoding="utf-8")
    dom = _Dom()
    dom.feed(dump_dom(path, tmp_path / "profile"))
    return dom


def assert_every_cell_is_in_the_dom(results: SweepResults, dom: _Dom) -> None:
    expected = {(c.prompt_id, c.point): c.text for c in results.cells}
    assert set(dom.cells) == {(p.id, point) for p in results.prompts for point in results.points}
    for key, text in expected.items():
        assert dom.cells[key] == text, key
    # the inline script ran: it wrote the (empty) marks and the count of prompts
    assert dom.by_id["choices"] == "{}"
    assert dom.by_id["marked"] == f"0 of {len(results.prompts)} prompts marked"


def test_the_shipped_sweep_renders_every_output(tmp_path: Path) -> None:
    results = SweepResults.from_json(SHIPPED.read_text(encoding="utf-8"))
    assert len(results.cells) == len(results.prompts) * len(results.points) and not any(c.error for c in results.cells)
    assert_every_cell_is_in_the_dom(results, browser_dom(render_page(results), tmp_path))


def test_hostile_texts_stay_text_in_the_browser(tmp_path: Path) -> None:
    prompts = [Prompt("p<1>", "factual", 'What is "x" & <y>?'), Prompt("长城", "chinese", "请介绍长城。")]
    points = parse_grid("temperature=0,0.7 top_p=0.9,1.0")
    texts = ['</td><script>document.title="pwned"</script>', "line one\n  line two", "长城是中国的古代防御工程。",
             "it's \"quoted\" & <b>bold</b>", "", "plain"]
    cells = [Cell.of(p.id, g, texts[(i * len(points) + j) % len(texts)], [1, 2, 3, 1, 2, 3], "stop")
             for i, p in enumerate(prompts) for j, g in enumerate(points)]
    results = SweepResults(seed=3, max_new_tokens=8, grid="temperature=0,0.7 top_p=0.9,1.0", prompts=prompts,
                           points=[g.label for g in points], cells=cells)
    page = render_page(results)
    assert " src=" not in page and "http" not in page.replace("http-equiv", "")  # nothing loaded from anywhere
    dom = browser_dom(page, tmp_path)
    assert dom.scripts == 1  # only the page's own script; the output's <script> stayed text
    assert_every_cell_is_in_the_dom(results, dom)


def test_a_failed_call_shows_its_error_in_its_cell(tmp_path: Path) -> None:
    prompt = Prompt("p", "", "hi")
    results = SweepResults(seed=0, max_new_tokens=8, grid="temperature=0", prompts=[prompt],
                           points=["temperature=0"],
                           cells=[Cell("p", "temperature=0", "", 0, 0, 0, 0, "", error="DEADLINE_EXCEEDED: <late>")])
    dom = browser_dom(render_page(results), tmp_path)
    assert dom.cells[("p", "temperature=0")] == "error: DEADLINE_EXCEEDED: <late>"


# Click radio buttons as a judge would, then the download button; what the download holds.
_MARK_AND_EXPORT = """(async () => {
  let blob = null;
  const create = URL.createObjectURL;
  URL.createObjectURL = b => { blob = b; return create(b); };
  const [first, second] = document.querySelectorAll('table.prompt');
  const firstRadios = first.querySelectorAll('input.best');
  firstRadios[2].click();
  second.querySelectorAll('input.best')[0].click();
  firstRadios[1].click();  // the judge changes their mind: the prompt keeps one mark
  document.getElementById('export').click();
  return {file: blob && await blob.text(), marked: document.getElementById('marked').textContent,
          shown: document.getElementById('choices').textContent};
})()"""


def test_the_judges_marks_are_downloaded_as_json(tmp_path: Path) -> None:
    prompts = [Prompt('say "hi"', "factual", "a"), Prompt("长城", "chinese", "b"), Prompt("c", "", "c")]
    points = parse_grid("temperature=0,0.7,1.0")
    results = SweepResults(seed=5, max_new_tokens=4, grid="temperature=0,0.7,1.0", prompts=prompts,
                           points=[g.label for g in points],
                           cells=[Cell.of(p.id, g, "x", [1], "stop") for p in prompts for g in points])
    page = tmp_path / "sweep.html"
    page.write_text(render_page(results), encoding="utf-8")
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(page)
        got = browser.evaluate(_MARK_AND_EXPORT)
    finally:
        browser.close()
    best = {'say "hi"': "temperature=0.7", "长城": "temperature=0"}
    assert json.loads(got["file"]) == {"grid": "temperature=0,0.7,1.0", "seed": 5, "best": best}
    assert json.loads(got["shown"]) == best
    assert got["marked"] == "2 of 3 prompts marked"
