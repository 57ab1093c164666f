"""`gyre inspect SHARD`: what a trajectory shard holds, and one execution's tree drawn as text.

The tree drawing keeps a straight conversation at one indentation level and only indents where
the tree branches (compaction, sub-agent, retry), so a 600-call execution stays readable; long
straight runs are folded to their first and last nodes unless ``--full`` is given.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from gyre.traj.record import ExecutionRecord
from gyre.traj.store import DATASETS, ShardError, read_attrs, read_shard, shard_paths
from gyre.traj.tree import ROOT, TrajectoryTree

FOLD_KEEP = 3  # nodes kept at each end of a folded straight run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shard", nargs="+", help="HDF5 trajectory shards (.h5) or directories of them")
    p.add_argument("--execution", metavar="ID",
                   help="execution to draw: its execution_id or its row number (default: the first)")
    p.add_argument("--max-depth", type=int, metavar="N", default=None,
                   help="draw nodes down to depth N only (depth 1 = first message)")
    p.add_argument("--full", action="store_true", help="do not fold long straight runs of nodes")
    p.add_argument("--no-verify", action="store_true", help="skip checksum verification")
    p.add_argument("--text", action="store_true",
                   help="show each drawn node's text, decoded through the model's tokenizer (--model)")
    p.add_argument("--model", metavar="DIR", help="model directory whose tokenizer.json decodes --text "
                                                  "(default: the embedded tiny model)")


# the executions table on a narrow terminal keeps these columns (the others need ~150)
NARROW = ("#", "execution", "status", "reward", "calls", "tokens uniq/exp", "duration")


def _summary(console: Console, path: Path, attrs: dict, records: list[ExecutionRecord]) -> None:
    head = Table(title=f"shard {path.name}", show_header=False, title_justify="left")
    head.add_row("path", str(path))
    head.add_row("size", f"{os.path.getsize(path):,} bytes")
    head.add_row("schema", f"{attrs.get('schema')} v{attrs.get('schema_version')}")
    head.add_row("written", f"{attrs.get('created')} by gyre {attrs.get('gyre_version')}")
    for k in sorted(a for a in attrs if a.startswith("identity_")):
        head.add_row(k.replace("_", " ", 1), str(attrs[k]))
    head.add_row("checksums", ", ".join(f"{d} {str(attrs.get(f'sha256_{d}', '?'))[:12]}" for d in DATASETS))
    console.print(head)

    cols = ("#", "execution", "task", "group", "status", "reward", "passed", "versions", "calls",
            "leaves", "nodes uniq/exp", "tokens uniq/exp", "duration")
    keep = cols if console.width >= 150 else NARROW
    t = Table(title=f"{len(records)} executions" + ("" if keep == cols else " (a wider terminal shows task, group, "
                                                    "passed, versions, leaves, nodes)"), title_justify="left")
    for col in keep:
        t.add_column(col, justify="right" if col not in ("execution", "task", "status") else "left",
                     overflow="fold")
    for i, r in enumerate(records):
        s = r.tree.stats()
        row = dict(zip(cols, (str(i), r.execution_id, r.task, str(r.group), r.status,
                              f"{r.reward:.3f} ({r.reward_source})" if r.reward == r.reward else "-",
                              f"{r.passed}/{r.total}", f"{r.min_version}..{r.max_version}", str(s.calls),
                              str(s.leaves), f"{s.unique_nodes:,}/{s.expanded_nodes:,}",
                              f"{s.unique_tokens:,}/{s.expanded_tokens:,}", f"{r.t_end - r.t_start:,.1f}s")))
        t.add_row(*(row[c] for c in keep))
    console.print(t)


def _label(tree: TrajectoryTree, nid: int, decode=None) -> str:
    n = tree.nodes[nid]
    text = f"[dim]#{nid}[/] [bold]{n.message_role}[/] [cyan]{n.agent_role}[/] {len(n.tokens):,} tok"
    if n.is_target:
        text += f" [green]target {n.n_targets:,}[/] v{n.policy_version} call {n.call_index}"
    if decode is not None:  # the node's exact tokens as text (special tokens shown), escaped for rich
        text += "\n" + escape(decode([int(t) for t in n.tokens]))
    return text


def draw_tree(tree: TrajectoryTree, title: str, max_depth: int | None = None, full: bool = False,
              decode=None) -> Tree:
    """A rich Tree: straight runs at one level, a new level per branch."""
    kids: dict[int, list[int]] = {}
    depth: dict[int, int] = {ROOT: 0}
    for n in tree.nodes:  # parents come before children
        kids.setdefault(n.parent, []).append(n.id)
        depth[n.id] = depth[n.parent] + 1
    root = Tree(title)

    def branch(start: int, holder: Tree) -> None:
        # follow single children; nest only where the tree forks
        chain, nid = [start], start
        while len(kids.get(nid, [])) == 1:
            nid = kids[nid][0]
            chain.append(nid)
        if max_depth is not None:
            chain = [c for c in chain if depth[c] <= max_depth]
        shown = chain if full or len(chain) <= 2 * FOLD_KEEP + 1 else None
        if shown is None:
            for c in chain[:FOLD_KEEP]:
                holder.add(_label(tree, c, decode))
            hidden = chain[FOLD_KEEP:-FOLD_KEEP]
            toks = sum(len(tree.nodes[c].tokens) for c in hidden)
            holder.add(f"[dim]... {len(hidden)} more nodes, {toks:,} tokens ...[/]")
            shown = chain[-FOLD_KEEP:]
        for c in shown:
            holder.add(_label(tree, c, decode))
        if chain and chain[-1] == nid and (max_depth is None or depth[nid] < max_depth):
            for k, child in enumerate(kids.get(nid, [])):
                branch(child, holder.add(f"[yellow]branch {k + 1}/{len(kids[nid])}[/]"))

    for child in kids.get(ROOT, []):
        branch(child, root.add("[yellow]root[/]"))
    return root


def _pick(records: list[ExecutionRecord], wanted: str | None) -> ExecutionRecord | None:
    if wanted is None:
        return records[0] if records else None
    for r in records:
        if r.execution_id == wanted:
            return r
    if wanted.isdigit() and int(wanted) < len(records):
        return records[int(wanted)]
    return None


def _decoder(args: argparse.Namespace, attrs: dict, console: Console):
    """tokenizer.json of --model (default: the tiny model) as ids -> text; warns when the shard
    names another tokenizer (the text would be wrong, the tokens are not)."""
    from tokenizers import Tokenizer

    from gyre.config import default_tiny_dir, load_config
    from gyre.model.identity import model_identity

    model = Path(args.model) if args.model else default_tiny_dir(load_config())
    tok_file = model / "tokenizer.json"
    if not tok_file.is_file():
        raise SystemExit(f"gyre inspect: --text needs a tokenizer: {tok_file} not found; pass --model DIR "
                         f"(the model the shard was recorded with)")
    want = attrs.get("identity_tokenizer")
    have = model_identity(model).get("tokenizer_hash")
    if want and have and want != have:
        console.print(f"[yellow]gyre inspect: the shard was recorded with tokenizer {str(want)[:12]}, {model} has "
                      f"{str(have)[:12]}: the text shown may be wrong; pass --model DIR[/]")
    tok = Tokenizer.from_file(str(tok_file))
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def run(args: argparse.Namespace) -> int:
    # piped output (logs, grep) gets whole lines instead of rich's 80-column default
    console = Console(width=None if sys.stdout.isatty() else 200)
    missing = [p for p in args.shard if not Path(p).exists()]
    if missing:
        console.print(f"[red]gyre inspect: no such file or directory:[/] {', '.join(missing)}", highlight=False)
        return 2
    paths = shard_paths(args.shard)
    if not paths:
        console.print(f"[red]gyre inspect: no shard (*.h5) in[/] {', '.join(args.shard)}", highlight=False)
        return 2
    found: list[tuple[Path, dict, ExecutionRecord]] = []
    for path in paths:
        try:
            attrs = read_attrs(path)
            records = read_shard(path, verify=not args.no_verify)
        except ShardError as e:
            console.print(f"[red]gyre inspect: bad shard[/] {e.path}\n  dataset: {e.dataset}\n  {e.reason}",
                          highlight=False, soft_wrap=True)
            return 1
        _summary(console, path, attrs, records)
        found += [(path, attrs, r) for r in records]
    pick = _pick([r for _, _, r in found], args.execution)
    if pick is None:
        if args.execution is not None:
            console.print(f"[red]gyre inspect: no execution {args.execution!r} in {', '.join(map(str, paths))}[/]")
            return 1
        return 0
    _, attrs, rec = next(f for f in found if f[2] is pick)
    s = rec.tree.stats()
    title = (f"[bold]{escape(rec.execution_id)}[/] ({escape(rec.task)}): {s.calls} calls, {s.leaves} leaves, "
             f"{s.unique_nodes:,} unique / {s.expanded_nodes:,} expanded nodes")
    decode = _decoder(args, attrs, console) if args.text else None
    console.print(draw_tree(rec.tree, title, args.max_depth, args.full, decode))
    return 0
