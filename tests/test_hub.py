"""`pretrain export --push-to-hub REPO`: a bad repo id is refused before anything is exported, and a failed upload
is said in one line that keeps the export. Never touches the network (the Hub client is replaced)."""

from __future__ import annotations

import json

import pytest

from pretrain.cli import main
from pretrain.core.errors import UserError


def test_a_bad_repo_id_is_refused_before_exporting(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    # the run does not exist: the repo id is refused before the export would even look for it
    assert main(["export", str(tmp_path / "no-run"), "--push-to-hub", "me/my model"]) == 2
    err = capsys.readouterr().err
    assert "--push-to-hub 'me/my model': not a Hub repo id" in err and "nothing was exported" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("failure", ["offline", "http"])
def test_a_failed_upload_keeps_the_export_and_says_why(tmp_path, monkeypatch, failure):
    import huggingface_hub
    from huggingface_hub.errors import OfflineModeIsEnabled

    from pretrain.hf.hub import push_to_hub

    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"model_type": "bert"}))

    class FailingApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, **kwargs):
            if failure == "offline":
                raise OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled.")
            raise ValueError("the Hub answered 500")

        def upload_folder(self, **kwargs):  # pragma: no cover - create_repo fails first
            raise AssertionError("not reached")

    monkeypatch.setattr(huggingface_hub, "HfApi", FailingApi)
    with pytest.raises(UserError) as err:
        push_to_hub(export, "me/tiny", token="hf_test_token")
    message = str(err.value)
    assert message.startswith("--push-to-hub me/tiny: the upload failed (")
    assert ("offline mode is enabled" if failure == "offline" else "the Hub answered 500") in message
    assert f"the export is kept at {export}" in message
    assert (export / "config.json").is_file()
