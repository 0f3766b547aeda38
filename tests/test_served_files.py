"""What clients are shown of the server's files (mdi.serving.served_files): paths relative to
the models folder, in error messages too (`scrub`), the folder's own spelling or its real one."""
import os

from mdi.serving.served_files import ServedFiles


def test_scrub_shows_paths_under_the_models_folders_relative_to_them(tmp_path):
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    link = tmp_path / "link"
    os.symlink(str(models), str(link))
    files = ServedFiles(str(link / "m"), {})
    real = os.path.realpath(str(models))
    message = ("adapter x: %s/lora-b is not a directory; [Errno 2] No such file: '%s/lora-b/adapter_config.json' "
               "in %s. %s/m (%s)" % (real, str(link), real, real + "-old", real))
    shown = files.scrub(message)
    assert shown == ("adapter x: lora-b is not a directory; [Errno 2] No such file: 'lora-b/adapter_config.json' "
                     "in .. %s/m (.)" % (real + "-old")), shown
    assert files.scrub("POST /adapters/3 failed with HTTP 413") == "POST /adapters/3 failed with HTTP 413"


def test_a_training_out_under_a_file_is_named_relative_to_the_models_folder(tmp_path):
    """`out` inside a file: one readable line naming both by their models-folder paths (h97: it
    read "play.txt/x play.txt is a file", the server's own path in the middle)."""
    from mdi.serving.train_body import out_problem
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "play.txt").write_text("text")
    files = ServedFiles(str(models / "m"), {})
    problem = out_problem(os.path.realpath(str(models / "play.txt" / "x")), files)
    assert problem == "play.txt/x: play.txt is a file, not a directory", problem
    assert str(tmp_path) not in problem
