"""examples/: the plain PyTorch script and the same script on zerolab, run as a user runs them (python,
torchrun), train the same model: the zerolab run's loss on the global batch is the plain run's."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32, 30 AdamW steps of a model of 100k parameters: the same sums in another order (an all-reduce of two
# half batches against one process's backward) move the loss by about 1e-7; a wrong average moves it by 1e-2
TOL = 1e-5


def run(*cmd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    loss = float(re.search(r"^final loss (\S+)$", out.stdout, re.M).group(1))
    text = re.search(r"^sample: '(.*)'$", out.stdout, re.M).group(1)
    return loss, text


def test_the_zerolab_script_trains_as_the_plain_one_under_python_and_torchrun():
    plain, text = run(sys.executable, "examples/train_plain.py")
    assert text.startswith("It was the ") and len(text) > len("It was the ")
    launched, text_launched = run(sys.executable, "examples/train_zerolab.py", "2")
    assert abs(launched - plain) < TOL and text_launched.startswith("It was the ")
    torchrun, _ = run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                      "examples/train_zerolab.py")
    assert abs(torchrun - plain) < TOL
