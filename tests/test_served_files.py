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
