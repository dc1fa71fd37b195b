"""The labs' messages, in one process (no ranks): numbers printed to the digits where they differ,
and a file the grader cannot grade refused in one line, before any rank starts."""

import pytest

from zerolab.labs import grade
from zerolab.labs.__main__ import main as labs_cli
from zerolab.labs.checks import digits, expected_seen


def test_two_numbers_are_printed_to_the_digit_where_they_differ():
    # (three significant digits would print both as 1.23e-05)
    assert digits(1.23456e-05, 1.23457e-05) == ("1.23456e-05", "1.23457e-05")
    assert digits(0.0968, 0.194) == ("0.0968", "0.194")
    assert digits(-0.00062615, -0.00062620) == ("-0.00062615", "-0.0006262")
    assert digits(0.5, 0.5) == ("0.5", "0.5")            # equal numbers stay equal: the caller says why
    import torch
    assert expected_seen(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.00001]), 1) == \
        "expected 2, seen 2.00001"


@pytest.mark.parametrize("name, words", [
    ("afile.txt", ("afile.txt is not a Python file", "labs/lab3_ddp.py")),
    ("03_ddp.ipynb", ("03_ddp.ipynb is a notebook", "the .py file next to it", "labs/lab3_ddp.py")),
    ("missing.py", ("there is no file", "missing.py", "labs/lab3_ddp.py")),
    ("a_folder", ("is a folder", "labs/lab3_ddp.py")),
])
def test_a_file_the_grader_cannot_import_is_one_line_on_the_command_line(tmp_path, capsys, name, words):
    path = tmp_path / name
    if name == "a_folder":
        path.mkdir()
    elif name != "missing.py":
        path.write_text("hello\n")
    assert labs_cli(["grade", "ddp", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("python -m zerolab.labs grade ddp: ")
    assert all(w in err for w in words), err


def test_a_file_that_is_not_python_is_a_failed_check_in_a_notebook(tmp_path):
    path = tmp_path / "afile.txt"
    path.write_text("hello\n")
    report = grade("ddp", str(path), show=False)
    first = report.first_failure
    assert not report.passed and first.key == "file" and "is not a Python file" in first.line
    assert all(v.status == "FAIL" for v in report.verdicts) and len(report.verdicts) == 1
