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
    token = hub_token()
    if not token:
        raise UserError(
            f"--push-to-hub {repo_id}: no Hugging Face token configured; set HF_TOKEN or run "
            "`hf auth login` (nothing was exported or uploaded)"
        )
    return token


def push_to_hub(folder: str | Path, repo_id: str, token: str | None = None) -> str:
    """Upload an export directory to the model repo `repo_id` (created if missing); returns its URL. Only the files
    the export wrote go up: what the user keeps beside them in the directory (notes, a fine-tuned model) stays."""
    import huggingface_hub

    from pretrain.hf.export import EXPORT_ENTRIES, check_model_dir

    check_model_dir(folder)
    token = token or check_hub_token(repo_id)
    api = huggingface_hub.HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        allow_patterns=[p for name in sorted(EXPORT_ENTRIES - {MARKER}) for p in (name, f"{name}/*")],
        ignore_patterns=[f"**/{MARKER}", MARKER],
        commit_message=f"Upload {Path(folder).name} exported by pretrain",
    )
    return f"https://huggingface.co/{repo_id}"
