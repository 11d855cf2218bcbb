"""YAML as users write it: the files they hand to Leadtime (fleets, plugin configurations, discovery, time-slice
states). PyYAML keeps the last of a key written twice, so `count: 2` followed further down by `count: 3` would run
with 3 and say nothing; here it is an error naming where. Imports nothing else of Leadtime's.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode


class _UniqueKeys(yaml.SafeLoader):
    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # what a `<<` merge brings may be overridden, as YAML allows
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable):
                if key in seen:
                    raise ConstructorError(None, None, f"the key {key!r} is given twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, refusing a key given twice in one mapping (yaml.YAMLError, with the line).

    >>> load_yaml("pools: [{name: a, count: 2}]")
    {'pools': [{'name': 'a', 'count': 2}]}
    >>> try:
    ...     load_yaml("name: a\\ncount: 2\\ncount: 3\\n")
    ... except yaml.YAMLError as err:
    ...     print(err.problem, "at line", err.problem_mark.line + 1)
    the key 'count' is given twice at line 3
    """
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass
