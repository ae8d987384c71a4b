"""Upload an export directory to the HuggingFace Hub (`pretrain export --push-to-hub REPO`)."""

from __future__ import annotations

import os
from pathlib import Path

from pretrain.core.errors import UserError
from pretrain.core.outputs import MARKER


def hub_token() -> str | None:
    """HF_TOKEN, or the token stored by `hf auth login`."""
    import huggingface_hub

    return os.environ.get("HF_TOKEN") or huggingface_hub.get_token()


def check_hub_token(repo_id: str) -> str:
    """The token to upload to `repo_id` with, after checking the id itself: both said before anything is exported."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise UserError(
            f"--push-to-hub {repo_id!r}: not a Hub repo id ({err}); nothing was exported or uploaded"
        ) from None
    token = hub_token()
    if not token:
        raise UserError(
            f"--push-to-hub {repo_id}: no Hugging Face token configured; set HF_TOKEN or run "
            "`hf auth login` (nothing was exported or uploaded)"
        )
    return token


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    token: str | None = None,
    files: list[str] | None = None,
    private: bool = False,
    revision: str | None = None,
) -> str:
    """Upload an export directory to the model repo `repo_id` (created if missing, `private` where asked; a repo
    that exists keeps its visibility) on branch `revision` (created from main if missing; default main); returns
    its URL. Only `files`, the exact paths the export wrote (default: a transformers export's), go up: what the user
    keeps beside them in the directory (notes, a fine-tuned model) stays. Files of ours in the repo that this export
    no longer writes (an earlier ELECTRA export's generator/) are deleted in the same commit: the repo holds this
    export, not a mix of two; the user's own files there are left alone."""
    import huggingface_hub

    from pretrain.hf.export import EXPORT_ENTRIES, check_model_dir

    check_model_dir(folder)
    token = token or check_hub_token(repo_id)
    files = files if files is not None else upload_patterns(EXPORT_ENTRIES)
    api = huggingface_hub.HfApi(token=token)
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", exist_ok=True, private=private or None)
        if revision:
            api.create_branch(repo_id=repo_id, branch=revision, repo_type="model", exist_ok=True)
        api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            revision=revision,
            allow_patterns=files,
            ignore_patterns=[f"**/{MARKER}", MARKER],
            delete_patterns=files,
            commit_message=f"Upload {Path(folder).name} exported by pretrain",
        )
    except _upload_errors() as err:  # offline, refused, network down: the export is done, and stays
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"--push-to-hub {repo_id}: the upload failed ({type(err).__name__}: {reason}); the export is kept at "
            f"{folder}: run the same command again to retry"
        ) from None
    return f"https://huggingface.co/{repo_id}" + (f"/tree/{revision}" if revision else "")


def upload_patterns(entries: frozenset[str], subdirs: dict[str, list[str]] | None = None) -> list[str]:
    """The exact paths an export writes, for the Hub client's fnmatch (where `*` crosses '/'): each file entry at the
    top and each directory entry's own files (default: ELECTRA's generator/, which holds the top's file names). No
    wildcard: 'generator/*' took the user's notes kept in generator/ too."""
    files = sorted(entries - {MARKER, "generator"} - set(subdirs or {}))
    subdirs = {"generator": files} if subdirs is None else subdirs
    return [*files, *(f"{folder}/{name}" for folder, names in subdirs.items() for name in names)]


def _upload_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises for a failed request: OSError (its HTTP errors, offline mode), ValueError (a bad
    answer), and its HTTP library's own errors (a connection refused), whichever library that is."""
    from huggingface_hub.errors import HfHubHTTPError

    http = tuple(c for c in HfHubHTTPError.__mro__ if c.__name__ == "HTTPError" and c is not HfHubHTTPError)
    return (OSError, ValueError, *http)
