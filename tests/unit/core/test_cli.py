from nexrl.cli import main


def test_bad_override_exits_2_naming_the_key(capsys):
    assert main(["train", "train_worker.total_train_steps=abc"]) == 2
    assert "train_worker.total_train_steps" in capsys.readouterr().err


def test_malformed_dataset_row_exits_2_naming_the_row(tmp_path, capsys, tiny_model_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "abcd>", "answer": "bcde"}\n{"question": "x"}\n')
    code = main(
        ["train", f"data.path={bad}", f"model_path={tiny_model_path}", f"output_dir={tmp_path}"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "row 1" in err and "prompt" in err and str(bad) in err


def test_unknown_command_prints_usage(capsys):
    assert main(["frobnicate"]) == 2
    assert "usage: nexrl" in capsys.readouterr().err


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path):
    from nexrl.run_setup import new_run_dir

    first, second = new_run_dir(tmp_path), new_run_dir(tmp_path)
    assert first != second and first.is_dir() and second.is_dir()
