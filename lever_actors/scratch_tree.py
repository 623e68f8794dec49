"""The drafter's scratch tree: every token drafted or assumed below the committed root.

Pure Python, no model. Node ``i`` has token ``tok[i]`` below ``par[i]`` (-1: the root, the last
committed token); the drafter keeps its K/V rows in KV slot (committed length + i) and its final
hidden row in ``hid[i]`` once it has been fed. Nodes are keyed by (parent, token), so a token
drafted twice under the same path is one node, and a node's id is always larger than its parent's.
"""
from __future__ import annotations

import numpy as np


class ScratchTree:
    def __init__(self) -> None:
        self.tok: list[int] = []
        self.par: list[int] = []
        self.hid: list[np.ndarray | None] = []
        self.children: dict[int, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.tok)

    def child(self, parent: int, token: int) -> int | None:
        return self.children.get(parent, {}).get(int(token))

    def add(self, parent: int, token: int) -> int:
        """The node of ``token`` below ``parent``, added (not yet fed) if new."""
        node = self.child(parent, token)
        if node is None:
            node = self.children.setdefault(parent, {})[int(token)] = len(self.tok)
            self.tok.append(int(token))
            self.par.append(parent)
            self.hid.append(None)
        return node

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.par[node]
        return out[::-1]

    def walk(self, tokens) -> list[int]:
        """The fed nodes along the longest prefix of ``tokens`` the tree holds, from the root."""
        node, nodes = -1, []
        for t in tokens:
            child = self.child(node, t)
            if child is None or self.hid[child] is None:
                break
            nodes.append(child)
            node = child
        return nodes

    def below(self, node: int) -> list[int]:
        """The nodes of the subtree below ``node`` (not itself), parents first."""
        inside, out = {node}, []
        for i in range(node + 1, len(self.tok)):
            if self.par[i] in inside:
                inside.add(i)
                out.append(i)
        return out

    def rebased(self, nodes: list[int], root: int) -> "ScratchTree":
        """A tree of ``nodes`` (parents first, all below ``root``) with ``root`` as its root; node
        ``nodes[j]`` becomes node ``j``, as its KV row moves to slot (new committed length + j)."""
        new_id = {root: -1} | {old: j for j, old in enumerate(nodes)}
        tree = ScratchTree()
        for old in nodes:
            j = tree.add(new_id[self.par[old]], self.tok[old])
            tree.hid[j] = self.hid[old]
        return tree
