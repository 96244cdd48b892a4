"""Write the repository's public address into pyproject.toml for the Comfy registry: ``[project.urls]``
(Repository, Issues) and ``[tool.comfy]``'s Icon, the address of docs/images/icon.svg as the host serves the
file itself.

    python tools/publish_address.py https://github.com/OWNER/REPO [--branch main]
    python tools/publish_address.py https://git.example.org/OWNER/REPO --icon-url https://…/icon.svg

GitHub and GitLab addresses give the icon's address themselves (the raw file on ``--branch``); for any other
host give it with ``--icon-url``. Running it again with another address replaces the first; every other
line of pyproject.toml, comments included, is kept. Exits 2 with one line on a bad address.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
ICON = "docs/images/icon.svg"
URLS_TABLE = "[project.urls]"
# Where the table goes when pyproject.toml has none: before the first table after [project]'s own keys.
URLS_BEFORE = "[project.optional-dependencies]"
ICON_LINE = re.compile(r'^Icon = ".*"$', re.MULTILINE)


def repository_address(text: str) -> str:
    """``text`` as a repository's web address: https, a host, an owner and a name (a trailing ``.git`` or
    slash dropped)."""
    address = text.strip().removesuffix("/").removesuffix(".git")
    parts = urlsplit(address)
    path = [part for part in parts.path.split("/") if part]
    if parts.scheme != "https" or not parts.netloc or len(path) < 2 or parts.query or parts.fragment:
        raise ValueError(
            f"{text!r} is not a repository's web address: give https://HOST/OWNER/REPO, "
            "e.g. https://github.com/OWNER/comfyui-pixart-lowvram"
        )
    return f"https://{parts.netloc}/{'/'.join(path)}"


def icon_address(repository: str, branch: str) -> str | None:
    """docs/images/icon.svg as the host serves the raw file, for GitHub and GitLab; None for other hosts."""
    parts = urlsplit(repository)
    if parts.netloc == "github.com":
        return f"https://raw.githubusercontent.com{parts.path}/{branch}/{ICON}"
    if parts.netloc == "gitlab.com":
        return f"{repository}/-/raw/{branch}/{ICON}"
    return None


def with_address(pyproject: str, repository: str, icon: str) -> str:
    """pyproject.toml's text with ``[project.urls]`` (put before ``[project.optional-dependencies]``, in place
    of any there was) and the Icon set."""
    table = re.search(rf"^{re.escape(URLS_TABLE)}$", pyproject, re.MULTILINE)
    if table:  # the earlier address's table, up to the next table
        end = pyproject.find("\n[", table.start())
        pyproject = pyproject[: table.start()] + (pyproject[end + 1 :] if end >= 0 else "")
    before = f"\n{URLS_BEFORE}\n"
    if before not in pyproject:
        raise ValueError(f"pyproject.toml has no {URLS_BEFORE} table to put {URLS_TABLE} before")
    urls = f'{URLS_TABLE}\nRepository = "{repository}"\nIssues = "{repository}/issues"\n\n'
    pyproject = pyproject.replace(before, f"\n{urls}{URLS_BEFORE}\n", 1)
    if not ICON_LINE.search(pyproject):
        raise ValueError('pyproject.toml has no Icon = "…" line in [tool.comfy]')
    return ICON_LINE.sub(f'Icon = "{icon}"', pyproject, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repository", help="the repository's web address, e.g. https://github.com/OWNER/REPO")
    parser.add_argument(
        "--branch", default="main", help="the branch the icon's address reads (GitHub, GitLab)"
    )
    parser.add_argument("--icon-url", default=None, help=f"the address of {ICON} as the host serves it")
    parser.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml", help="the file to write")
    args = parser.parse_args(argv)
    try:
        repository = repository_address(args.repository)
        icon = args.icon_url or icon_address(repository, args.branch)
        if icon is None:
            raise ValueError(
                f"{urlsplit(repository).netloc} is not GitHub or GitLab: give the icon's address with "
                f"--icon-url (the raw {ICON} as that host serves it)"
            )
        if urlsplit(icon).scheme != "https":
            raise ValueError(f"--icon-url {icon!r}: give an https address")
        args.pyproject.write_text(with_address(args.pyproject.read_text(encoding="utf-8"), repository, icon))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.pyproject}: Repository {repository}, Icon {icon}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
