"""rollstream.infra.demo: the README's main job (``rollstream demo``) and its agent."""

from rollstream.infra.demo.run import DemoSettings, reward_table, rewards_by_version, run

__all__ = ["DemoSettings", "reward_table", "rewards_by_version", "run"]
