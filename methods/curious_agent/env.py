"""MiniGrid with the 28x28 RGB partial view, the deterministic slot-text describer and coverage.

The describer reads the 7x7 symbolic partial view (never shown to the policy): it is the ground
truth of r^reason and of the perception warm-up only.
"""
from __future__ import annotations

import gymnasium as gym
import minigrid  # noqa: F401  (registers the MiniGrid-* ids)
import numpy as np
from minigrid.core.constants import IDX_TO_OBJECT, STATE_TO_IDX
from minigrid.wrappers import RGBImgPartialObsWrapper

MINIMAL_ACTIONS = [0, 1, 2, 3, 5]  # left, right, forward, pickup, toggle
ALL_ACTIONS = [0, 1, 2, 3, 4, 5, 6]  # + drop, done
ACTION_NAMES = ["left", "right", "forward", "pickup", "drop", "toggle", "done"]

CELLS = [IDX_TO_OBJECT[i] for i in range(len(IDX_TO_OBJECT))]  # unseen, empty, wall, ...
CARRY = ["none", "key", "ball", "box"]
DOOR = ["locked", "closed", "open", "unseen"]
GOAL = ["visible", "unseen"]
SLOTS = [("front", CELLS), ("left", CELLS), ("right", CELLS), ("carry", CARRY), ("door", DOOR), ("goal", GOAL)]
_STATE = {v: k for k, v in STATE_TO_IDX.items()}
AGENT_X, AGENT_Y = 3, 6  # the agent's cell in the 7x7 egocentric view (facing up)


def describe(symbolic: np.ndarray, carrying) -> list[int]:
    """Slot values (indices into each slot's value list) of a 7x7x3 symbolic partial view."""
    objects, states = symbolic[:, :, 0], symbolic[:, :, 2]
    front, left, right = objects[AGENT_X, AGENT_Y - 1], objects[AGENT_X - 1, AGENT_Y], objects[AGENT_X + 1, AGENT_Y]
    carry = CARRY.index(carrying.type) if carrying is not None and carrying.type in CARRY else 0
    door = DOOR.index("unseen")
    doors = np.argwhere(objects == CELLS.index("door"))
    if len(doors):  # nearest visible door (Manhattan distance from the agent)
        x, y = min(doors, key=lambda c: abs(c[0] - AGENT_X) + abs(c[1] - AGENT_Y))
        door = DOOR.index(_STATE[int(states[x, y])])
    goal = GOAL.index("visible" if (objects == CELLS.index("goal")).any() else "unseen")
    return [int(front), int(left), int(right), carry, door, goal]


def splitting_door_column(grid) -> int:
    """x of the only door when its column is wall everywhere else (DoorKey's layout); -1 otherwise."""
    doors = [(x, y) for x in range(grid.width) for y in range(grid.height)
             if (c := grid.get(x, y)) is not None and c.type == "door"]
    if len(doors) != 1:
        return -1
    x = doors[0][0]
    column = [grid.get(x, y) for y in range(grid.height) if y != doors[0][1]]
    return x if all(c is not None and c.type == "wall" for c in column) else -1


class GridEnvs:
    """n MiniGrid copies stepped in lockstep with auto-reset; tracks (x, y, dir) visits."""

    def __init__(self, env_id: str, n: int, seed: int, actions: str = "minimal", tile_size: int = 4,
                 max_steps: int = 0):
        kwargs = {"max_steps": max_steps} if max_steps > 0 else {}
        self.envs = [RGBImgPartialObsWrapper(gym.make(env_id, **kwargs), tile_size=tile_size) for _ in range(n)]
        self.actions = MINIMAL_ACTIONS if actions == "minimal" else ALL_ACTIONS
        self.seed = seed
        self.episodes_started = 0
        self.visits: dict[tuple, int] = {}
        self.frames = np.zeros((n, 3, 7 * tile_size, 7 * tile_size), np.float32)
        self.slots = np.zeros((n, len(SLOTS)), np.int64)
        self.first_visit = np.zeros(n, bool)
        self.open_cells: set[tuple[int, int]] = set()  # non-wall cells of every layout seen so far
        self.door_x = np.full(n, -1)  # column of a door in a wall that splits the grid (DoorKey), else -1
        for i in range(n):
            self._reset(i)

    def _reset(self, i: int) -> None:
        obs, _ = self.envs[i].reset(seed=self.seed + self.episodes_started)  # fresh layout per episode
        self.episodes_started += 1
        grid = self.envs[i].unwrapped.grid
        self.open_cells.update((x, y) for x in range(grid.width) for y in range(grid.height)
                               if (c := grid.get(x, y)) is None or c.type != "wall")
        self.door_x[i] = splitting_door_column(grid)
        self._store(i, obs)

    def _store(self, i: int, obs) -> None:
        env = self.envs[i].unwrapped
        self.frames[i] = np.asarray(obs["image"], np.float32).transpose(2, 0, 1) / 255.0
        self.slots[i] = describe(env.gen_obs()["image"], env.carrying)
        self._visit(i)

    def _visit(self, i: int) -> None:
        env = self.envs[i].unwrapped
        key = (int(env.agent_pos[0]), int(env.agent_pos[1]), int(env.agent_dir))
        self.first_visit[i] = key not in self.visits
        self.visits[key] = self.visits.get(key, 0) + 1

    def step(self, action_ids: np.ndarray):
        """-> reward, done, success, novel (o_{t+1} is a first visit), next frames and slots (both
        before auto-reset: o_{t+1} is the frame a_t produced, the target of the alignment)."""
        n = len(self.envs)
        rewards, dones, successes, novel = np.zeros(n), np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
        next_frames, next_slots = np.empty_like(self.frames), np.empty_like(self.slots)
        for i, env in enumerate(self.envs):
            obs, reward, terminated, truncated, _ = env.step(self.actions[int(action_ids[i])])
            self._store(i, obs)
            next_frames[i], next_slots[i], novel[i] = self.frames[i], self.slots[i], self.first_visit[i]
            rewards[i], dones[i], successes[i] = reward, terminated or truncated, terminated and reward > 0
            if dones[i]:
                self._reset(i)
        return rewards, dones, successes, novel, next_frames, next_slots

    def past_door(self) -> np.ndarray:
        """Per env: the agent stands beyond the splitting door (DoorKey's goal room; it starts left of it)."""
        return np.array([x >= 0 and int(env.unwrapped.agent_pos[0]) > x for x, env in zip(self.door_x, self.envs)])

    @property
    def reachable(self) -> int:
        return 4 * len(self.open_cells)  # (x, y, dir) over the union of the layouts' non-wall cells

    def coverage(self) -> float:
        return len(self.visits) / self.reachable
