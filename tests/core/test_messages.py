"""One protocol family (gyre.messages): the head<->cell commands and the agent<->ranks requests are
both Messages, both receivers' tables are built by `dispatch_table`, and an unknown message gets
the same error on either side."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import ClassVar

import pytest

from gyre.cell import trainer_messages as tm
from gyre.cell.agent import CellAgent
from gyre.cell.command import CommandError
from gyre.cell.trainer_rank import Rank, dispatch
import gyre.messages
from gyre.messages import Message, dispatch_table, handler_for
from gyre.sched import protocol as hp
from gyre.sched.state import Role


def _types(module, base):
    return {c for c in vars(module).values() if isinstance(c, type) and issubclass(c, base) and c is not base}


def test_both_protocols_are_one_family_with_names_unique_per_side():
    for module, bases in ((hp, (hp.Command, hp.Reply, hp.Event)), (tm, (tm.Request, tm.Reply, tm.Started))):
        assert all(issubclass(b, Message) for b in bases), module.__name__
    commands, requests = _types(hp, hp.Command), _types(tm, tm.Request)
    for kinds in (commands, requests):
        names = [c.name for c in kinds]
        assert len(set(names)) == len(names) and "message" not in names
    assert set(hp.COMMANDS.values()) == commands  # the name -> type map the head's tools use
    # every command has a handler in the agent's table, as every dispatched request has in the ranks'
    assert set(CellAgent.HANDLERS) == commands
    assert set(Rank.HANDLERS) == requests - {tm.Start, tm.Close}


def test_a_table_refuses_what_is_not_a_message_or_shares_a_name():
    with pytest.raises(TypeError, match="'stash' is not a gyre.messages.Message type"):
        dispatch_table({"stash": print})

    @dataclasses.dataclass(frozen=True)
    class Stash2(tm.Request):
        name: ClassVar[str] = "stash"

    with pytest.raises(ValueError, match="Stash and Stash2 share the message name 'stash'"):
        dispatch_table({tm.Stash: print, Stash2: print})
    assert dispatch_table({tm.Stash: print}) == {tm.Stash: print}


def test_an_unknown_message_gets_the_same_error_on_both_sides():
    stray = hp.Stop()  # a head command sent down the trainer pipe
    ranks = dispatch(Rank.HANDLERS, None, stray)
    assert not ranks.ok and ranks.error.startswith("TypeError: unknown trainer request Stop; known: Apply,")

    @dataclasses.dataclass(kw_only=True)
    class Pause(hp.Command):
        name: ClassVar[str] = "pause"

    agent = CellAgent.__new__(CellAgent)  # no processes: the refusal comes before any handler
    agent.cell, agent.role, agent.lost = 3, Role.TRAIN, []
    reply = agent.handle(Pause(seq=7))
    assert (reply.ok, reply.seq, reply.cell, reply.role) == (False, 7, 3, Role.TRAIN)
    assert reply.error.startswith("unknown command Pause; known: PrepareReduce, PushWeights, Reduce, Stop,")
    # the one helper behind both: the protocol's own error type, the same words
    with pytest.raises(CommandError, match=r"^unknown command str 'x'; known: Stop$"):
        handler_for({hp.Stop: print}, "x", "command", CommandError)
    with pytest.raises(TypeError, match=r"^unknown trainer request tuple \('stash', \(2,\)\); known: Stop$"):
        handler_for({hp.Stop: print}, ("stash", (2,)), "trainer request")


def test_the_family_is_on_the_ground_floor():
    """Both `sched` and `cell` build on it, so it imports nothing of Gyre (docs/architecture.md)."""
    tree = ast.parse(Path(gyre.messages.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not [x for x in names if x.split(".")[0] == "gyre"], names
