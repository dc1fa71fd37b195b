"""Calculators that work in the page: plain HTML and JavaScript, no kernel, no network, no ipywidgets.

The built book is static HTML, where an ipywidgets slider is dead: nothing runs its callback. Each
function here returns an `IPython.display.HTML` holding a small form and a script; the script
recomputes the answer in the browser whenever an input moves. The same object works in the built
book and in a live notebook (JupyterLab runs the script of an output the reader produced).

    bit_toggler("fp16")        chapter 1: click the bits of a number, see what they mean
    memory_calculator()        chapter 3: model-state bytes per device, and the largest model per stage
    planner()                  chapter 10: which stages fit, with activations

The formulas are written twice on purpose: in Python in zerolab (numerics.from_bits,
memory.model_state_bytes and max_params, calculator.activation_bytes and plan) and in JavaScript
in FORMULAS_JS below. tests/test_web_widgets.py runs FORMULAS_JS with node on a grid of inputs and
compares every number and every printed line with the Python, so a slip in either one fails it.

Before any script runs, the HTML already shows the answer for the default inputs, computed here in
Python: a page whose scripts are blocked still shows a correct result.

No element has an id. Each widget's root carries data-zl-widget="<kind>"; its script sets up every
root of that kind not set up yet and looks for inputs only inside that root. Two calculators on one
page, or two notebooks open side by side in JupyterLab (one document), cannot clash, and the HTML
is the same on every run, so nbval can compare it.
"""

from __future__ import annotations

import html
import json
import math

from ..theory import calculator as calc
from .. import memory
from ..theory import numerics as N

ND_OPTIONS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)   # the N_d choices of the sliders
NM_OPTIONS = (1, 2, 4, 8, 16)
FIELD_COLORS = {"sign": "#f4a6a6", "exponent": "#a6c8f4", "mantissa": "#b8e6b0"}   # as fp_plots draws them

# ------------------------------------------------------------------ the formulas, in JavaScript

FORMULAS_JS = r"""
// ---- numbers printed as Python prints them: format(x, ".2f"), ",.1f", "g", ".3g" and repr(x).
// Python rounds the exact binary value half to even; toFixed rounds ties away from zero. Ties
// happen (1.125 GB), so round exactly, in integers: a finite double is m * 2^e.
function zlExact(x) {                       // |x| = m * 2^e, as two BigInts
  const v = new DataView(new ArrayBuffer(8));
  v.setFloat64(0, Math.abs(x));
  const hi = v.getUint32(0), field = hi >>> 20;
  let m = (BigInt(hi & 0xfffff) << 32n) | BigInt(v.getUint32(4));
  if (field > 0) m |= 1n << 52n;            // the hidden leading 1 of a normal number
  return [m, BigInt((field > 0 ? field : 1) - 1075)];
}
function zlScaled(x, s) {                   // round(|x| * 10^s), half to even, as a BigInt
  let [num, e] = zlExact(x), den = 1n;
  if (e >= 0n) num <<= e; else den <<= -e;
  if (s >= 0) num *= 10n ** BigInt(s); else den *= 10n ** BigInt(-s);
  const q = num / den, twice = 2n * (num % den);
  return twice > den || (twice === den && q % 2n === 1n) ? q + 1n : q;
}
function zlSign(x) { return x < 0 || Object.is(x, -0) ? "-" : ""; }
function zlPoint(digits, d) {               // ("12345", 2) -> "123.45", ("5", 3) -> "0.005"
  digits = digits.padStart(d + 1, "0");
  return d > 0 ? digits.slice(0, -d) + "." + digits.slice(-d) : digits;
}
function zlFixed(x, d, comma) {             // format(x, ".{d}f"), or ",.{d}f" with comma
  let [whole, frac] = zlPoint(zlScaled(x, d).toString(), d).split(".");
  if (comma) whole = whole.replace(/\B(?=(\d{3})+$)/g, ",");
  return zlSign(x) + whole + (frac === undefined ? "" : "." + frac);
}
function zlG(x, p) {                        // format(x, ".{p}g"); format(x, "g") is p = 6
  if (x === 0) return zlSign(x) + "0";
  // X: the decimal exponent of x once rounded to p digits (log10 gives a guess, integers decide)
  let X = Math.floor(Math.log10(Math.abs(x))), n = zlScaled(x, p - 1 - X);
  while (n >= 10n ** BigInt(p)) { X += 1; n = zlScaled(x, p - 1 - X); }
  while (n < 10n ** BigInt(p - 1)) { X -= 1; n = zlScaled(x, p - 1 - X); }
  const trim = (s) => (s.includes(".") ? s.replace(/\.?0+$/, "") : s);
  if (X >= -4 && X < p) return zlSign(x) + trim(zlPoint(n.toString(), p - 1 - X));
  const exp = (X < 0 ? "-" : "+") + String(Math.abs(X)).padStart(2, "0");
  return zlSign(x) + trim(zlPoint(n.toString(), p - 1)) + "e" + exp;
}
function zlRepr(x) {                        // repr(x) of a Python float
  if (Number.isNaN(x)) return "nan";
  if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
  if (x === 0) return zlSign(x) + "0.0";
  // toExponential() with no argument gives the shortest digits that read back as x, as repr does
  const [mant, e] = Math.abs(x).toExponential().split("e"), X = Number(e);
  const digits = mant.replace(".", "");
  let s;
  if (X >= 16 || X < -4) {
    s = digits[0] + (digits.length > 1 ? "." + digits.slice(1) : "") + "e" + (X < 0 ? "-" : "+") +
        String(Math.abs(X)).padStart(2, "0");
  } else if (X >= 0) {
    const whole = digits.slice(0, X + 1).padEnd(X + 1, "0");
    s = whole + "." + (digits.slice(X + 1) || "0");
  } else {
    s = "0." + "0".repeat(-X - 1) + digits;
  }
  return zlSign(x) + s;
}

// ---- chapter 1: what a bit pattern means (zerolab.theory.numerics.from_bits)
function zlDecode(bits, E, M, hasInf) {     // {value, kind} of a pattern with E exponent, M mantissa bits
  const top = 2 ** E - 1, bias = 2 ** (E - 1) - 1;
  const sign = Math.floor(bits / 2 ** (E + M)) % 2;       // arithmetic, not <<: 32-bit patterns stay unsigned
  const field = Math.floor(bits / 2 ** M) % 2 ** E, mant = bits % 2 ** M;
  let value;
  if (field === top && hasInf) value = mant === 0 ? Infinity : NaN;
  else if (field === top && mant === 2 ** M - 1) value = NaN;   // e4m3: no inf, one NaN pattern
  else if (field === 0) value = 2 ** (1 - bias) * (mant / 2 ** M);   // subnormal: no hidden 1
  else value = 2 ** (field - bias) * (1 + mant / 2 ** M);
  if (sign === 1) value = -value;
  const kind = Number.isNaN(value) ? "nan" : !Number.isFinite(value) ? "inf"
    : field === 0 ? (mant === 0 ? "zero" : "subnormal") : "normal";
  return {value: value, kind: kind, sign: sign, field: field, mant: mant, bias: bias};
}

// ---- chapter 3: model states per device (zerolab.memory)
function zlBytesPerParam(nD, stage, k = 12, p = 2, g = 2) {
  let o = k;
  if (stage >= 1) o = o / nD;               // P_os: optimizer states sharded
  if (stage >= 2) g = g / nD;               // P_os+g: gradients too
  if (stage >= 3) p = p / nD;               // P_os+g+p: parameters too
  return p + g + o;
}
function zlModelStateBytes(psi, nD, stage, k = 12) { return psi * zlBytesPerParam(nD, stage, k); }
function zlMaxParams(deviceBytes, nD, stage, k = 12, nM = 1) {
  return nM * deviceBytes / zlBytesPerParam(nD, stage, k);
}
function zlMemoryLines(billions, nD, stage, deviceGb) {   // what chapter 3's calculator prints
  const need = zlModelStateBytes(billions * 1e9, nD, stage) / 1e9;
  const lines = [zlG(billions, 6) + "B parameters, N_d=" + nD + ", stage " + stage + ": " + zlFixed(need, 2) +
    " GB of model states per device -> " + (need <= deviceGb ? "fits" : "does NOT fit") + " in " + deviceGb + " GB"];
  for (let s = 0; s <= 3; s++) {
    lines.push("  largest model that fits with stage " + s + ": " +
               zlFixed(zlMaxParams(deviceGb * 1e9, nD, s) / 1e9, 1, true) + "B parameters");
  }
  return lines;
}

// ---- chapter 10: which stages fit, with activations (zerolab.theory.calculator)
function zlActivationBytes(hidden, batch, seq, layers, nM, ckpt, partitioned, bytesPerValue = 2) {
  const perLayer = hidden * batch * seq * (ckpt ? 1 : 12);   // the paper's 12 h b s per layer, or one input
  const total = perLayer * layers * bytesPerValue;
  return partitioned ? total / nM : total;                   // P_a splits checkpoints N_m ways
}
function zlPlan(psi, deviceGb, nD, nM, activationsGb, k = 12) {
  const rows = [];
  for (let stage = 0; stage <= 3; stage++) {
    const states = zlModelStateBytes(psi / nM, nD, stage, k) / 1e9, total = states + activationsGb;
    rows.push({stage: stage, states: states, activations: activationsGb, total: total,
               room: deviceGb - total, fits: total <= deviceGb});
  }
  return rows;
}
function zlGb(v) { return Math.abs(v) >= 100 ? zlFixed(v, 0, true) : zlG(v, 3); }
function zlPlanCells(a) {                   // the planner's table, as calculator.format_plan writes it
  const act = zlActivationBytes(a.hidden, a.batch, a.seq, a.layers, a.n_m, a.ckpt, a.ckpt && a.n_m > 1) / 1e9;
  return zlPlan(a.psi_billions * 1e9, a.device_gb, a.n_d, a.n_m, act).map((r) =>
    [ZL_STAGE_LABELS[r.stage], zlGb(r.states), zlGb(r.activations), zlGb(r.total), zlGb(r.room),
     r.fits ? "yes" : "no"]);
}
""" + f"const ZL_STAGE_LABELS = {json.dumps([calc.STAGE_LABELS[s] for s in calc.STAGES])};\n"

# ------------------------------------------------------------------ the page side, in JavaScript

_SETUP_JS = r"""
// Sliders show the value they stand for; every input change recomputes the result.
function zlLogValue(slider) { return Number(Math.pow(10, Number(slider.value)).toPrecision(3)); }  // 3 digits
function zlReadout(input) {
  const kind = input.dataset.scale;
  if (kind === "log") {                     // the number box beside it holds the value (typed or slid)
    const typed = Number(input.parentElement.querySelector("input[data-typed]").value);
    return typed > 0 ? typed : zlLogValue(input);
  }
  if (kind === "options") return JSON.parse(input.dataset.options)[Number(input.value)];
  return input.type === "checkbox" ? input.checked : Number(input.value);
}
function zlWire(root, update) {
  const refresh = () => {
    const values = {};
    root.querySelectorAll("[data-arg]").forEach((input) => {
      values[input.dataset.arg] = zlReadout(input);
      const out = input.parentElement.querySelector("output");
      if (out) out.textContent = String(values[input.dataset.arg]);
    });
    update(values);
  };
  // a log slider and its number box move together: slide to explore, type for an exact value
  root.querySelectorAll("input[data-typed]").forEach((box) => {
    const slider = box.parentElement.querySelector("[data-scale=log]");
    slider.addEventListener("input", () => { box.value = zlLogValue(slider); });
    box.addEventListener("input", () => { if (Number(box.value) > 0) slider.value = Math.log10(Number(box.value)); });
  });
  root.querySelectorAll("[data-arg], input[data-typed]").forEach((input) => input.addEventListener("input", refresh));
  refresh();
}
const ZL_SETUP = {
  memory: (root) => zlWire(root, (v) => {
    root.querySelector(".zl-result").textContent = zlMemoryLines(v.billions, v.n_d, v.stage, v.device_gb).join("\n");
  }),
  planner: (root) => zlWire(root, (v) => {
    root.querySelectorAll(".zl-result tbody tr").forEach((tr, i) => {
      zlPlanCells(v)[i].forEach((text, j) => { tr.children[j].textContent = text; });
    });
  }),
  bits: (root) => {
    const formats = JSON.parse(root.dataset.formats), row = root.querySelector(".zl-bits");
    const select = root.querySelector("select"), label = root.querySelector(".zl-result");
    const show = () => {
      const f = formats[select.value], buttons = Array.from(row.children);
      const bits = buttons.reduce((acc, b) => acc * 2 + Number(b.textContent), 0);
      const d = zlDecode(bits, f.E, f.M, f.inf);
      const pattern = buttons.map((b) => b.textContent).join("");
      label.innerHTML = "<code>" + select.value + "</code> bits <code>" + pattern + "</code> = <b>" +
        zlRepr(d.value) + "</b> (" + d.kind + ")";
      root.querySelector(".zl-fields").innerHTML = d.kind === "nan" || d.kind === "inf"
        ? "exponent field all ones: " + d.kind       // the fields, as the formula of chapter 1 reads them
        : "(&minus;1)<sup>" + d.sign + "</sup> &times; 2<sup>" + (d.field === 0 ? 1 : d.field) + " &minus; " +
          d.bias + "</sup> &times; (" + (d.field === 0 ? "0" : "1") + " + " + d.mant + "/" + 2 ** f.M + ")" +
          (d.field === 0 ? " (subnormal: no hidden 1, exponent 1 &minus; bias)" : "");
    };
    const build = () => {                   // one button per bit, starting from 1.0 in that format
      const f = formats[select.value];
      row.innerHTML = "";
      f.start.split("").forEach((ch, i) => {
        const b = document.createElement("button");
        b.type = "button";
        b.textContent = ch;
        b.className = "zl-bit";
        b.style.background = f.colors[i];
        b.addEventListener("click", () => { b.textContent = b.textContent === "1" ? "0" : "1"; show(); });
        row.appendChild(b);
      });
      show();
    };
    select.addEventListener("change", build);
    build();
  },
};
"""

_CSS = """<style>
.zl-widget { border: 1px solid #c8c8c8; border-radius: 6px; padding: 0.6em 0.9em; margin: 0.6em 0; }
.zl-widget label { display: inline-flex; align-items: center; gap: 0.4em; margin: 0.2em 1.2em 0.2em 0; }
.zl-widget output { font-family: monospace; min-width: 3.5em; }
.zl-widget pre.zl-result { margin: 0.6em 0 0; padding: 0.5em; white-space: pre-wrap; font-size: 0.85em; }
.zl-widget table { border-collapse: collapse; margin-top: 0.6em; font-size: 0.9em; }
.zl-widget td:first-child { white-space: nowrap; }
.zl-widget th, .zl-widget td { padding: 0.15em 0.7em; border-bottom: 1px solid #ddd; text-align: right; }
.zl-widget th:first-child, .zl-widget td:first-child, .zl-widget td:last-child { text-align: left; }
.zl-widget .zl-bits { display: flex; flex-wrap: wrap; gap: 2px; margin: 0.5em 0; }
.zl-widget .zl-bit { width: 1.6em; padding: 0.2em 0; border: 1px solid #888; border-radius: 3px;
  font-family: monospace; color: #000; cursor: pointer; }
.zl-widget .zl-fields { font-family: monospace; font-size: 0.9em; opacity: 0.8; }
</style>"""


def _page(kind: str, body: str, attrs: str = ""):
    """The widget's root, its form and the script that brings it to life."""
    from IPython.display import HTML

    script = ("<script>(function () {\n" + FORMULAS_JS + _SETUP_JS +
              f"document.querySelectorAll('[data-zl-widget=\"{kind}\"]:not([data-zl-ready])')"
              ".forEach((root) => { root.dataset.zlReady = '1'; ZL_SETUP['" + kind + "'](root); });\n"
              "})();</script>")
    return HTML(f'{_CSS}\n<div class="zl-widget" data-zl-widget="{kind}"{attrs}>\n{body}\n</div>\n{script}')


def _slider(arg: str, text: str, lo, hi, step, value) -> str:
    return (f'<label>{text} <input type="range" data-arg="{arg}" min="{lo}" max="{hi}" step="{step}" '
            f'value="{value}"><output>{value}</output></label>')


def _log_slider(arg: str, text: str, value: float) -> str:
    # ipywidgets' FloatLogSlider(min=-1, max=4): 0.1 to 10,000. Sliding gives 3-digit values; the
    # number box beside it takes an exact one (an exercise may ask for 30B).
    return (f'<label>{text} <input type="range" data-arg="{arg}" data-scale="log" min="-1" max="4" '
            f'step="any" value="{math.log10(value)!r}"><input type="number" data-typed min="0.1" max="10000" '
            f'step="any" value="{value:g}" style="width: 6em"></label>')


def _options_slider(arg: str, text: str, options, value) -> str:
    if value not in options:
        raise ValueError(f"{arg} must be one of {list(options)}; got {value!r}")
    return (f'<label>{text} <input type="range" data-arg="{arg}" data-scale="options" '
            f"data-options='{json.dumps(list(options))}' min=\"0\" max=\"{len(options) - 1}\" step=\"1\" "
            f'value="{options.index(value)}"><output>{value}</output></label>')


def _in_range(name, value, lo, hi, step=None):
    """The slider's domain: [lo, hi], in whole steps from lo when step is given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi \
            or (step is not None and (value - lo) % step):
        steps = f" in steps of {step}" if step is not None else ""
        raise ValueError(f"{name} must be in [{lo}, {hi}]{steps}; got {value!r}")


# ------------------------------------------------------------------ chapter 1: the bit toggler


def _bits_label(bits: int, fmt) -> str:
    """What the toggler prints for a pattern, computed by zerolab.theory.numerics."""
    f = N.get_format(fmt)
    value = N.from_bits(bits, f)
    kind = N._bits(bits, f).kind
    return f"<code>{f.name}</code> bits <code>{bits:0{f.bits}b}</code> = <b>{value!r}</b> ({kind})"


def bit_toggler(fmt: str = "fp16"):
    """Click the bits of a number (1.0 to start) in fp32, fp16, bf16, e4m3 or e5m2; see the value."""
    f = N.get_format(fmt)
    formats = {}
    for name in N.NAMES:
        g = N.get_format(name)
        colors = [FIELD_COLORS["sign" if i == 0 else "exponent" if i <= g.exponent_bits else "mantissa"]
                  for i in range(g.bits)]
        formats[name] = {"E": g.exponent_bits, "M": g.mantissa_bits, "inf": g.has_inf,
                         "start": format(N.to_bits(1.0, g), f"0{g.bits}b"), "colors": colors}
    options = "".join(f'<option value="{n}"{" selected" if n == f.name else ""}>{n}</option>' for n in N.NAMES)
    start = formats[f.name]["start"]
    buttons = "".join(f'<button type="button" class="zl-bit" style="background:{formats[f.name]["colors"][i]}">'
                      f"{ch}</button>" for i, ch in enumerate(start))
    body = (f"<label>format <select>{options}</select></label>"
            f'<div class="zl-bits">{buttons}</div>'
            f'<div class="zl-result">{_bits_label(int(start, 2), f)}</div><div class="zl-fields"></div>')
    return _page("bits", body, f" data-formats='{html.escape(json.dumps(formats))}'")


# ------------------------------------------------------------------ chapter 3: the memory calculator


def _memory_lines(billions: float, n_d: int, stage: int, device_gb: int) -> list[str]:
    """What chapter 3's calculator prints, computed by zerolab.memory."""
    need = memory.model_state_bytes(billions * 1e9, n_d, stage) / 1e9
    fits = "fits" if need <= device_gb else "does NOT fit"
    lines = [f"{billions:g}B parameters, N_d={n_d}, stage {stage}: {need:.2f} GB of model states per device "
             f"-> {fits} in {device_gb} GB"]
    for s in (0, 1, 2, 3):
        most = memory.max_params(device_gb * 1e9, n_d, s) / 1e9
        lines.append(f"  largest model that fits with stage {s}: {most:,.1f}B parameters")
    return lines


def memory_calculator(billions: float = 7.5, n_d: int = 64, stage: int = 2, device_gb: int = 32):
    """Model-state GB per device for Psi parameters over N_d ranks at a ZeRO stage, whether it fits
    in the device's memory, and the largest model each stage fits (mixed-precision Adam, K = 12)."""
    _in_range("billions", billions, 0.1, 1e4)
    _in_range("stage", stage, 0, 3, 1)
    _in_range("device_gb", device_gb, 8, 192, 8)
    body = (_log_slider("billions", "<span>Ψ (billions)</span>", billions) + _options_slider("n_d", "<span>N<sub>d</sub></span>", ND_OPTIONS, n_d) +
            _slider("stage", "stage", 0, 3, 1, stage) + _slider("device_gb", "device GB", 8, 192, 8, device_gb) +
            f'<pre class="zl-result">{html.escape(chr(10).join(_memory_lines(billions, n_d, stage, device_gb)))}</pre>')
    return _page("memory", body)


# ------------------------------------------------------------------ chapter 10: the planner


def _plan_cells(psi_billions, device_gb, n_d, n_m, batch, seq, layers, hidden, ckpt) -> list[list[str]]:
    """The planner's table, as zerolab.theory.calculator computes and formats it (chapter 10's `show`)."""
    act = calc.activation_bytes(hidden, batch, seq, layers, n_m=n_m, checkpointing=ckpt,
                                partitioned=ckpt and n_m > 1) / 1e9
    text = calc.format_plan(calc.plan(psi_billions * 1e9, device_gb, n_d, n_m, activations_gb=act))
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()[2:]]


def planner(psi_billions: float = 7.5, device_gb: int = 32, n_d: int = 64, n_m: int = 1, batch: int = 8,
            seq: int = 1024, layers: int = 32, hidden: int = 4096, ckpt: bool = True):
    """Model states, activations, total and room per device for each ZeRO stage (activations by the
    paper's estimate; with checkpointing one input per layer, split N_m ways by P_a when N_m > 1)."""
    _in_range("psi_billions", psi_billions, 0.1, 1e4)
    for name, v, lo, hi, step in (("device_gb", device_gb, 8, 192, 8), ("batch", batch, 1, 64, 1),
                                  ("seq", seq, 128, 8192, 128), ("layers", layers, 1, 200, 1),
                                  ("hidden", hidden, 256, 16384, 256)):
        _in_range(name, v, lo, hi, step)
    head = "".join(f"<th>{h}</th>" for h in ("stage", "model states (GB)", "activations (GB)", "total (GB)",
                                              "room (GB)", "fits"))
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
                   for cells in _plan_cells(psi_billions, device_gb, n_d, n_m, batch, seq, layers, hidden, ckpt))
    body = (_log_slider("psi_billions", "<span>Ψ (billions)</span>", psi_billions) +
            _slider("device_gb", "device GB", 8, 192, 8, device_gb) +
            _options_slider("n_d", "<span>N<sub>d</sub></span>", ND_OPTIONS, n_d) + _options_slider("n_m", "<span>N<sub>m</sub></span>", NM_OPTIONS, n_m) +
            _slider("batch", "batch", 1, 64, 1, batch) + _slider("seq", "sequence", 128, 8192, 128, seq) +
            _slider("layers", "layers", 1, 200, 1, layers) + _slider("hidden", "hidden", 256, 16384, 256, hidden) +
            f'<label>checkpointing <input type="checkbox" data-arg="ckpt"{" checked" if ckpt else ""}></label>'
            f'<table class="zl-result"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>')
    return _page("planner", body)
