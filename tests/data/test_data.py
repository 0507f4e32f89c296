"""mmalign.data.rows: JSONL loading with file:line errors, the line-length bound and prompt templates (the prompt
samplers: test_prompt_samplers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmalign.data.rows import MAX_LINE_BYTES, DataError, add_prompts, load_jsonl, load_rows, read_lines

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str | bytes, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def data_error(fn, *args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    return str(info.value)


GOOD = '{"question": "1 + 1", "answer": "2"}\n'


# ----------------------------------------------------------------------------- load_jsonl


def test_loads_rows_and_tags_their_source(tmp_path):
    path = write(tmp_path, GOOD + '{"question": "2 + 3", "answer": "5", "extra": [1, 2]}\n')
    rows = load_jsonl(path)
    assert [r["question"] for r in rows] == ["1 + 1", "2 + 3"]
    assert rows[1]["extra"] == [1, 2]
    assert [r["_source"] for r in rows] == [f"{path}:1", f"{path}:2"]


def test_malformed_line_3_names_path_and_line(tmp_path):
    path = write(tmp_path, GOOD + GOOD + '{"question": "3 + 4", "answer": \n' + GOOD)
    msg = data_error(load_jsonl, path)
    assert msg.startswith(f"{path}:3: invalid JSON")
    assert f"{path}:4" not in msg


def test_malformed_json_column_is_within_the_line(tmp_path):
    path = write(tmp_path, GOOD + '{"question": "x", oops}\n')
    msg = data_error(load_jsonl, path)
    assert msg.startswith(f"{path}:2: invalid JSON")
    assert "at column 19)" in msg  # 1-based column of `oops`


def test_truncated_last_line_without_newline(tmp_path):
    path = write(tmp_path, GOOD + '{"question": "x"')
    assert data_error(load_jsonl, path).startswith(f"{path}:2: invalid JSON")


@pytest.mark.parametrize(
    "line, kind", [("[1, 2, 3]", "list"), ('"just text"', "str"), ("42", "int"), ("null", "NoneType")]
)
def test_non_object_line_names_the_line(tmp_path, line, kind):
    path = write(tmp_path, GOOD + GOOD + line + "\n")
    msg = data_error(load_jsonl, path)
    assert msg == f"{path}:3: each line must be a JSON object, got {kind}"


def test_empty_file(tmp_path):
    path = write(tmp_path, "")
    msg = data_error(load_jsonl, path)
    assert str(path) in msg and "no rows" in msg


def test_only_blank_lines_is_empty(tmp_path):
    path = write(tmp_path, "\n   \n\t\n")
    assert "no rows" in data_error(load_jsonl, path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    assert data_error(load_jsonl, path).startswith(f"data file not found: {path}; set data.train to a JSONL")


def test_directory_is_not_a_data_file(tmp_path):
    assert "data file not found" in data_error(load_jsonl, tmp_path)


def test_blank_lines_are_skipped_but_counted(tmp_path):
    path = write(tmp_path, "\n" + GOOD + "   \n\n" + GOOD + "\r\n" + "[1]\n")
    with pytest.raises(DataError, match=rf"^{path}:7: each line must be a JSON object"):
        load_jsonl(path)
    path = write(tmp_path, "\n" + GOOD + "   \n\n" + GOOD)
    rows = load_jsonl(path)
    assert [r["_source"] for r in rows] == [f"{path}:2", f"{path}:5"]


def test_crlf_line_endings(tmp_path):
    path = write(tmp_path, GOOD.replace("\n", "\r\n") * 2)
    assert len(load_jsonl(path)) == 2


def test_utf8_bom_and_unicode(tmp_path):
    path = write(tmp_path, "\ufeff" + '{"question": "日本 + ü"}\n' + GOOD)
    rows = load_jsonl(path)
    assert rows[0]["question"] == "日本 + ü"
    assert rows[0]["_source"] == f"{path}:1"


def test_invalid_utf8_names_the_line(tmp_path):
    path = write(tmp_path, GOOD.encode() + b'{"question": "caf\xe9"}\n')
    msg = data_error(load_jsonl, path)
    assert msg.startswith(f"{path}:2: not valid UTF-8")


def test_max_rows_stops_early_and_ignores_later_lines(tmp_path):
    path = write(tmp_path, GOOD * 3 + "not json\n")
    assert len(load_jsonl(path, max_rows=2)) == 2
    assert len(load_jsonl(path, max_rows=3)) == 3
    with pytest.raises(DataError, match=":4: invalid JSON"):
        load_jsonl(path, max_rows=4)


def test_max_rows_zero_is_an_error_not_one_row(tmp_path):
    path = write(tmp_path, GOOD * 3)
    assert "max_rows" in data_error(load_jsonl, path, max_rows=0)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


# ----------------------------------------------------------------------------- prompts


def test_prompt_template_formats_every_row(tmp_path):
    path = write(tmp_path, GOOD + '{"question": "2 + 2", "answer": "4"}\n')
    rows = load_rows(str(path), "Q: {question} = ?\nA:")
    assert [r["prompt"] for r in rows] == ["Q: 1 + 1 = ?\nA:", "Q: 2 + 2 = ?\nA:"]
    assert rows[0]["answer"] == "2"  # other columns travel with the row


def test_prompt_template_missing_column_names_row_and_column(tmp_path):
    path = write(tmp_path, GOOD + "\n" + '{"query": "2 + 2", "answer": "4"}\n')
    msg = data_error(load_rows, str(path), "Q: {question} ({answer})")
    assert msg.startswith(f"{path}:3: ")
    assert "['question']" in msg and "data.prompt_template" in msg
    assert "answer" in msg and "query" in msg  # lists the row's columns
    assert "_source" not in msg


def test_prompt_template_attribute_and_index_fields(tmp_path):
    path = write(tmp_path, '{"q": {"text": "hi"}, "opts": ["a", "b"]}\n')
    rows = load_rows(str(path), "{q[text]} / {opts[1]}")
    assert rows[0]["prompt"] == "hi / b"
    msg = data_error(load_rows, str(path), "{missing[0]}")
    assert f"{path}:1" in msg and "['missing']" in msg


@pytest.mark.parametrize("template", ["Q: {question", "Q: question}"])
def test_malformed_template_is_a_data_error(template):
    msg = data_error(add_prompts, [{"question": "x", "_source": "f:1"}], template)
    assert "data.prompt_template" in msg and repr(template) in msg


@pytest.mark.parametrize("template", ["Q: {}", "Q: {0}"])
def test_positional_template_fields_are_rejected(template):
    msg = data_error(add_prompts, [{"question": "x", "_source": "f:1"}], template)
    assert "must name a column" in msg


def test_format_error_names_the_row():
    rows = [
        {"question": "1", "n": 3, "_source": "f.jsonl:1"},
        {"question": "2", "n": "x", "_source": "f.jsonl:2"},
    ]
    msg = data_error(add_prompts, rows, "{question} {n:d}")
    assert msg.startswith("f.jsonl:2: ")
    assert rows[0]["prompt"] == "1 3"


def test_default_template_keeps_an_existing_prompt_column():
    rows = [
        {"prompt": "P1", "_source": "f:1"},
        {"prompt": "P2", "question": "Q2", "_source": "f:2"},
        {"question": "Q3", "_source": "f:3"},
    ]
    out = add_prompts(rows, "{question}")
    assert [r["prompt"] for r in out] == ["P1", "P2", "Q3"]


def test_default_template_without_question_or_prompt_names_the_row():
    rows = [{"prompt": "P1", "_source": "f:1"}, {"text": "T", "_source": "f:2"}]
    msg = data_error(add_prompts, rows, "{question}")
    assert msg.startswith("f:2: the row has no 'prompt' column (nor 'question'") and "['text']" in msg


def test_custom_template_replaces_a_prompt_column():
    rows = [{"prompt": "old", "question": "Q", "_source": "f:1"}]
    assert add_prompts(rows, "> {question}")[0]["prompt"] == "> Q"


def test_bundled_tiny_data_loads():
    rows = load_rows(str(ROOT / "assets" / "text_reasoning" / "train.jsonl"), "Q: {question} = ?\nA:")
    assert len(rows) > 10
    assert all(r["prompt"].startswith("Q: ") and "answer" in r for r in rows)


def test_hf_dataset_saved_to_disk_loads_with_split_and_all_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    from mmalign.data.rows import DataError, load_rows

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"question": "1 + 1", "answer": "2", "level": 1}] * 3),
            "test": datasets.Dataset.from_list([{"question": "2 + 2", "answer": "4", "level": 2}]),
        }
    )
    dd.save_to_disk(str(tmp_path / "ds"))
    rows = load_rows(f"hf:{tmp_path / 'ds'}:test", "Q: {question}")
    assert len(rows) == 1 and rows[0]["prompt"] == "Q: 2 + 2" and rows[0]["level"] == 2
    assert rows[0]["_source"].endswith("[0]")
    with pytest.raises(DataError, match="no split 'validation'"):
        load_rows(f"hf:{tmp_path / 'ds'}:validation")
    with pytest.raises(DataError, match="expected hf:"):
        load_rows("hf:")


# ----------------------------------------------------------------------------- line length (issue 33, item 7)

BIG = 20 * 2**20
"""The over-long line of these tests: 20 MB (a 100 MB line killed the trainer; decoding took ~330x its size)."""


def write_long_line(path: Path, prefix: bytes, suffix: bytes) -> Path:
    """Line 1 a good row, line 2 `prefix` + BIG bytes of "x" + `suffix`, line 3 a good row; written in chunks."""
    with path.open("wb") as f:
        f.write(GOOD.encode())
        f.write(prefix)
        chunk = b"x" * 2**20
        for _ in range(BIG // len(chunk)):
            f.write(chunk)
        f.write(suffix + b"\n" + GOOD.encode())
    return path


def peak_bytes(fn, *args) -> tuple[str, int]:
    """(the DataError message `fn(*args)` raises, the peak bytes Python allocated meanwhile)."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(DataError) as info:
            fn(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return str(info.value), peak


@pytest.mark.parametrize(
    "name, prefix, suffix",
    [("d.jsonl", b'{"question": "', b'"}'), ("p.txt", b"", b"")],
    ids=["jsonl", "txt"],
)
def test_a_20mb_line_is_refused_naming_file_and_line_without_reading_it(tmp_path, name, prefix, suffix):
    path = write_long_line(tmp_path / name, prefix, suffix)
    msg, peak = peak_bytes(load_rows, str(path), "{question}")
    assert msg.startswith(f"{path}:2: line longer than {MAX_LINE_BYTES} bytes"), msg
    assert peak < 8 * 2**20, peak  # about one MAX_LINE_BYTES line held, not the 20 MB (nor 330x it)


def test_line_length_bound_is_exact_and_counts_bytes_without_the_line_break(tmp_path):
    ok = '{"question": "' + "é" * 10 + '"}'  # 14 + 10 x 2 (UTF-8 "é") + 2 = 36 bytes
    assert len(ok.encode()) == 36
    path = write(tmp_path, ok + "\r\n" + ok + "\n")
    assert len(load_jsonl(path, max_line_bytes=36)) == 2  # "\r\n" and "\n" do not count
    assert data_error(load_jsonl, path, max_line_bytes=35).startswith(f"{path}:1: line longer than 35 bytes")
    last = write(tmp_path, '{"question": "1"}\n' + ok, "last.jsonl")  # a last line without a line break
    assert data_error(load_jsonl, last, max_line_bytes=35).startswith(f"{last}:2: line longer than 35 bytes")


def test_lines_after_a_long_one_keep_their_numbers(tmp_path):
    path = write(tmp_path, "x" * 100 + "\n\nsecond prompt\n", "p.txt")
    assert list(read_lines(path, 20)) == [(1, None), (2, b""), (3, b"second prompt")]
