"""A rolling upgrade on real `join` processes (``p2pswarm.sim.rolling_upgrade``): the
previous release, built from this repository's history (``PREVIOUS_RELEASE``) into a
folder of its own, and this release form one swarm with one leader, serve a tiny model
and train a small job; then each previous-release fellow is stopped (SIGTERM) and started
again on this release from its state directory, on its address, the next only once it
is a member again, as `docker service update` with ``order: stop-first`` does, while a
client generates in a loop and the job trains: no client error, no job restart.

The load goes where the planner puts it, the fellows that are stopped included:
generations enter through every fellow, the previous release's too, and cross releases
on their way to it; a generation through a stage whose fellow leaves waits for the
leader to move the stage and resumes (docs/operations.md, "Upgrading a swarm").

Outside a git checkout (an sdist, an installed package), or in a shallow clone without
that commit, there is no history to build the previous release from: the test is
skipped, saying so. ``simulations/rolling_upgrade.py`` runs the same upgrade on six
fellows."""

from __future__ import annotations

import pytest

from p2pswarm.sim.rolling_upgrade import (
    PREVIOUS_RELEASE,
    Release,
    has_commit,
    previous_release,
    repository_root,
    run,
    verdict,
)

pytestmark = pytest.mark.slow  # real processes


@pytest.fixture(scope="session")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The previous release's tree, extracted once per test session."""
    repo = repository_root()
    if repo is None:
        pytest.skip("not in a git checkout: the previous release is built from its history")
    if not has_commit(repo):
        pytest.skip(f"the history lacks the previous release {PREVIOUS_RELEASE} (a shallow "
                    "clone? `git fetch --unshallow`)")
    return previous_release(repo, tmp_path_factory.mktemp("releases") / PREVIOUS_RELEASE)


def test_previous_release_is_built_from_history_and_imported_apart(previous: Release) -> None:
    assert previous.root is not None and (previous.root / "p2pswarm" / "__init__.py").is_file()
    assert previous.package() == previous.root / "p2pswarm"
    # a second build reuses the tree
    repo = repository_root()
    assert repo is not None and previous_release(repo, previous.root) == previous


def test_previous_release_fellows_replaced_one_at_a_time_while_serving_and_training(
        previous: Release) -> None:
    lines: list[str] = []
    report = run(previous=previous, fellows=4, new_at_start=1, say=lines.append,
                 rounds_before=1, rounds_after=1, checkpoints=False)
    assert verdict(report) == [], (report, lines)
    # the mixed swarm formed with one leader, served and trained before the upgrade
    assert report["mixed_leader"]["name"] in report["old_fellows"] + report["new_fellows"]
    assert report["mixed_served"] >= 1 and report["mixed_round"] >= 1, report
    assert [s["fellow"] for s in report["replaced"]] == report["old_fellows"], report
    assert report["client_errors"] == 0 and report["job"]["restarts"] == 0, report
    assert report["generations"] > report["mixed_served"], report
    print(f"rolling upgrade of 4 fellows: {report['run_s']} s in all, the upgrade "
          f"{report['upgrade_s']} s; {report['generations']} generations, "
          f"{report['client_errors']} errors; job {report['job']['state']} at step "
          f"{report['job']['step']}, {report['job']['restarts']} restarts; mixed leader "
          f"{report['mixed_leader']}; protocols {report['mixed_protocols']}; "
          f"{[(s['fellow'], s['member_again_s']) for s in report['replaced']]}")
