"""Run `make test` once under each CPU kernel set PyTorch can use on this machine.

PyTorch picks its vectorised kernels (ATen's CPU capability) at start-up: ATEN_CPU_CAPABILITY
asks for another set. Each set orders float sums differently, so this is how to check, on one
machine, that no test or compared notebook output depends on the low bits of such a sum.

    make test-kernels          (or: python tests/run_under_each_kernel.py)

prints one line per kernel set; each run's whole output is kept in _build/kernels/<set>.log.
Exit status 0 only if every run passed.
"""

import os
import re
import subprocess
import sys
import time

CANDIDATES = ("default", "avx2", "avx512", "sve256")   # x86-64 sets, then Arm's SVE


# The CPU flag each set needs (Linux's /proc/cpuinfo names). torch takes ATEN_CPU_CAPABILITY at its
# word on some machines (a virtual machine whose CPU hides AVX-512 from its flags, say): its kernels
# then die of SIGILL in the middle of the suite, so the flags are read as well.
NEEDS_FLAG = {"avx2": "avx2", "avx512": "avx512f", "sve256": "sve"}
# a few vectorised kernels of each kind (elementwise, reductions, a loss, softmax, a matmul)
PROBE = ("import torch; x = torch.randn(4096, requires_grad=True); "
         "torch.nn.functional.mse_loss(x.exp().sin(), x.detach()).backward(); "
         "torch.softmax(x.detach().view(64, 64) @ x.detach().view(64, 64), -1).sum().item(); "
         "print(torch.backends.cpu.get_cpu_capability())")


def cpu_flags() -> set | None:
    """The CPU's flags from /proc/cpuinfo (None where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith(("flags", "Features")) for w in line.split(":", 1)[1].split()}
    except OSError:
        return None


def capability_in_effect(asked: str) -> str | None:
    """What torch actually uses when asked for `asked` (it falls back when the CPU lacks it), or
    None when the CPU lacks it and torch uses it all the same."""
    flags = cpu_flags()
    if flags is not None and asked in NEEDS_FLAG and NEEDS_FLAG[asked] not in flags:
        return None
    env = dict(os.environ, ATEN_CPU_CAPABILITY=asked)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    return out.stdout.strip().lower() if out.returncode == 0 else None


def summary(log: str) -> str:
    """pytest's closing line, and the names of the tests that failed or could not run."""
    closing = [line.strip("= ") for line in log.splitlines() if re.search(r"\d+ (passed|failed|errors?)\b", line)]
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in log.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    text = closing[-1] if closing else "no pytest summary (see the log)"
    return text + ("; failed: " + ", ".join(failed) if failed else "")


def main() -> int:
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    supported = [c for c in CANDIDATES if capability_in_effect(c) == c]
    os.makedirs(os.path.join(top, "_build", "kernels"), exist_ok=True)
    print("kernel sets this CPU supports:", ", ".join(supported), flush=True)
    ok = True
    for cap in supported:
        start = time.time()
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
        run = subprocess.run(["make", "--no-print-directory", "test"], cwd=top, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with open(os.path.join(top, "_build", "kernels", f"{cap}.log"), "w") as f:
            f.write(run.stdout)
        ok &= run.returncode == 0
        verdict = "green" if run.returncode == 0 else f"RED (exit {run.returncode})"
        print(f"ATEN_CPU_CAPABILITY={cap:<8} {verdict}: {summary(run.stdout)} "
              f"[{time.time() - start:.0f} s wall]", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
