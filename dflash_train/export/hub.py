"""Pushing an exported drafter to the Hugging Face Hub.

The token comes only from huggingface_hub's own lookup (HF_TOKEN or ``hf auth login``); it
is never read, logged or written here.
"""

from __future__ import annotations

from pathlib import Path


def push_to_hub(export_dir: str | Path, repo_id: str, private: bool) -> str:
    """Create (or reuse) ``repo_id`` and upload the export folder; returns the commit URL."""
    from huggingface_hub import HfApi

    if not repo_id:
        raise ValueError("repo_id is empty: add repo_id=<user>/<name> to push")
    api = HfApi()  # the token is huggingface_hub's business: environment or cached login
    api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=str(export_dir), repo_type="model",
                             commit_message="Upload DFlash drafter (dflash-train)")
    return str(info)
