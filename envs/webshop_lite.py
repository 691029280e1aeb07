"""`webshop-lite`: an offline twin of WebShop (Yao et al., 2022) that runs anywhere.

Same pages, text and actions as WebShop's text environment (`WebAgentTextEnv`, observation_mode="text"):
pages are " [SEP] "-joined visible texts; the search page, results pages of 10 (Next > / < Prev), an
item page with its options, Description / Features / Reviews sub-pages and Buy Now; actions are
`search[keywords]` and `click[button]` with the button text lower-cased as WebShop does. The products
come from envs/webshop_catalog.py (generated from the seed) and are ranked by BM25 (`bm25s`) over
WebShop's search document (title, description, first bullet point, options).

Reward is WebShop's (web_agent_site/engine/goal.py), computed when Buy Now is clicked:
    r = r_type * (matched attributes + matched options + [price <= limit]) / (|attributes| + |options| + 1)
attribute match: token-set ratio > 85 against the product's attributes, or substring of its title,
bullet points or description; option match: token-set ratio > 85 after WebShop's colour normalisation,
each goal option taken as its (name, value) pair, as WebShop passes a dict's `.items()` (rapidfuzz, the
fast equivalent of the thefuzz library WebShop uses). r_type drops to 0.5 / 0.1 / 0 as the bought
product drifts from the goal's type. Success (info["won"]) = reward 1.0, as in verl-agent.

Split (ours; WebShop's goals are one per product and option combination, verl-agent holds out goals
0-499): held-out goals (tasks 0..eval_goals-1) target a held-out quarter of the catalogue, training
goals the other products (envs/webshop_catalog.py: 10 and 30 of the default 40, every held-out product
with a training sibling of its type), and a goal that some product of the other split would also win is
drawn again. So no held-out target, winning product or instruction text occurs among training goals.

Actions are parsed as WebShop parses them (`parse_action`: brackets on one line, the name exactly
`search` or `click`), and `search[...]` searches from any page, as in WebShop.

Differences from WebShop, on purpose: `click[search]` is not an action (in WebShop a silent no-op);
admissible actions are listed in verl-agent's form ("search[<your query>]" only on the search page,
where WebShop shows a search bar, "click[<button>]"); the type reward compares the goal's
type nouns with the bought title's words instead of spaCy noun chunks (our types are nouns only);
the done page is shortened; an invalid action is explained at the top of the unchanged page.
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
from functools import lru_cache

import bm25s
from rapidfuzz import fuzz, utils

from envs.webshop_catalog import KINDS, Difficulty, generate_catalogue, held_out_products, make_goal

SEARCH_RETURN_N = 50   # WebShop: results per search
PRODUCT_WINDOW = 10    # WebShop: results per page
MAX_ACTION_CHARS = 500  # longer text is not an action (and never reaches the regex)
SUB_PAGES = ["Description", "Features", "Reviews"]
ACTION_RE = re.compile(r"(.+)\[(.+)\]")  # WebShop's engine.parse_action: re.match, `.` stops at a newline

# web_agent_site/engine/normalize.py: an option value becomes the first of these it contains
COLOR_SET = [
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush",
    "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal",
    "cheetah", "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry",
    "cream", "crystal", "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite",
    "grape", "graphite", "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki",
    "lavender", "lemon", "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve", "merlot",
    "midnight", "mint", "mocha", "multicolor", "mushroom", "mustard", "natural", "navy", "nude", "olive",
    "orange", "peach", "pewter", "pink", "plum", "purple", "rainbow", "red", "rose", "royal", "rust",
    "sand", "sapphire", "seashell", "silver", "skull", "slate", "steel", "stone", "stonewash",
    "sunflower", "tan", "taupe", "teal", "tiger", "turquoise", "violet", "walnut", "wheat", "white",
    "wine", "yellow",
]


# ---- WebShop's reward (engine/goal.py) ----

def normalize_color(value: str | tuple) -> str | tuple:
    # a (name, value) pair (a dict goal's option, see webshop_reward) becomes a colour only when one of
    # its two strings is one: `in` tests membership of a tuple, substrings of a string
    return next((c for c in COLOR_SET if c in value), value)


def fuzzy_score(a: str | tuple, b: str | tuple) -> int:
    # thefuzz 0.19's token_set_ratio (WebShop's pin): anything not a string is str()-ed, then lower-case,
    # non-alphanumerics to spaces; rounded to an int
    return int(fuzz.token_set_ratio(str(a), str(b), processor=utils.default_process) + 0.5)


def type_reward(product: dict, goal: dict) -> float:
    """r_type: 1 if the bought product is the goal's kind of thing, else 0.5 / 0.1 / 0."""
    query_match = product["query"] == goal["query"]

    def path(p: dict) -> set[str]:
        return {x.strip() for x in p["product_category"].split("›")}

    category_match = len(path(product) & path(goal)) >= 2
    desired = goal["name"].lower().split()  # the goal type's nouns (WebShop: spaCy NOUN/PROPN tokens)
    title_words = set(re.findall(r"[a-z0-9-]+", product["Title"].lower()))
    title_score = len(set(desired) & title_words) / len(desired) if desired else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type


def attribute_matches(product: dict, goal_attributes: list[str]) -> int:
    text = " ".join([product["Title"], " ".join(product["BulletPoints"]), product["Description"]]).lower()
    return sum(any(fuzzy_score(p, g) > 85 for p in product["Attributes"]) or g in text
               for g in goal_attributes)


def option_matches(chosen: list[str], goal_options: list) -> int:
    chosen = [normalize_color(o) for o in chosen]
    return sum(any(fuzzy_score(p, normalize_color(g)) > 85 for p in chosen) for g in goal_options)


def webshop_reward(product: dict, goal: dict, chosen_options: dict) -> tuple[float, dict]:
    """The published WebShop reward (engine/goal.py get_reward)."""
    n_att = attribute_matches(product, goal["attributes"])
    # WebShop passes a dict goal's options as .items(): (name, value) pairs, matched against the chosen
    # values; a value the colour list would shorten ("standard" -> "tan") then never matches
    goal_options = goal["goal_options"]
    n_opt = option_matches(list(chosen_options.values()),
                           list(goal_options.items()) if isinstance(goal_options, dict) else goal_options)
    price_ok = product["price"] <= goal["price_upper"]
    r_type = type_reward(product, goal)
    total = len(goal["attributes"]) + len(goal["goal_options"]) + 1
    reward = r_type * (n_att + n_opt + price_ok) / total
    return reward, {"r_type": r_type, "attributes_matched": n_att, "options_matched": n_opt,
                    "price_ok": price_ok}


# ---- the action grammar ----

def parse_action(action) -> tuple[str, str] | str:
    """`search[...]` / `click[...]` -> (name, lower-cased argument), or a message saying what is wrong.
    As WebShop's engine.parse_action + WebAgentTextEnv.step: the pattern must match at the start of the
    action, its brackets on one line; text after the last `]` of that line is ignored; the name is
    exactly `search` or `click`; the argument is lower-cased, not stripped. Ours: the whole action is
    stripped first (verl-agent's projection strips what it extracts), and control characters refused."""
    if not isinstance(action, str):
        return f"an action is text, got {type(action).__name__}"
    action = action.strip()
    if not action:
        return "empty action; write search[keywords] or click[button]"
    if len(action) > MAX_ACTION_CHARS:
        return f"action is {len(action)} characters long; the limit is {MAX_ACTION_CHARS}"
    if any(unicodedata.category(c) in ("Cc", "Cs", "Co", "Cn") and c not in "\t\n" for c in action):
        return "action contains control or unprintable characters"
    m = ACTION_RE.match(action)
    if m is None or m.group(1) not in ("search", "click"):
        return f"{_show(action)} is not search[keywords] or click[button] (on one line)"
    return m.group(1), m.group(2).lower()


def _show(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def verl_observation(obs: str, instruction: str) -> str:
    """verl-agent's format_obs: drop everything up to the instruction, quote each remaining part."""
    parts = obs.split(" [SEP] ")
    if instruction not in parts:
        return obs
    return " [SEP] ".join(f"'{p}'" for p in parts[parts.index(instruction) + 1:])


def admissible_actions(has_search_bar: bool, clickables: list[str]) -> list[str]:
    """verl-agent's format_avail_actions: the search template, then one click per clickable."""
    return (["search[<your query>]"] if has_search_bar else []) + [f"click[{c}]" for c in clickables]


# ---- the shop ----

def search_document(p: dict) -> str:
    # WebShop's search_engine/convert_product_file_format.py document
    option_text = ", and ".join(f"{k}: {', '.join(v)}" for k, v in p["options"].items())
    return " ".join([p["Title"], p["Description"], p["BulletPoints"][0], option_text]).lower()


class Shop:
    """Catalogue + BM25 index, built once per (seed, difficulty) and shared read-only by all envs."""

    def __init__(self, seed: int, difficulty: Difficulty):
        self.products = generate_catalogue(seed, difficulty)
        self.by_asin = {p["asin"]: p for p in self.products}
        corpus = bm25s.tokenize([search_document(p) for p in self.products], stopwords="en",
                                show_progress=False)
        self.bm25 = bm25s.BM25()
        self.bm25.index(corpus, show_progress=False)
        self.lock = threading.Lock()

    def search(self, keywords: str) -> list[str]:
        """Top SEARCH_RETURN_N asins by BM25; ties keep catalogue order; no shared word -> no result."""
        tokens = bm25s.tokenize([keywords], stopwords="en", return_ids=False, show_progress=False)[0]
        if not tokens:
            return []
        with self.lock:
            scores = self.bm25.get_scores(tokens)  # (num_products,)
        ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [self.products[i]["asin"] for i in ranked[:SEARCH_RETURN_N] if scores[i] > 0]


@lru_cache(maxsize=8)
def get_shop(seed: int, difficulty: Difficulty) -> Shop:
    return Shop(seed, difficulty)


def wins(product: dict, goal: dict) -> bool:
    """Buying `product` with the goal's option values it offers earns reward 1.0."""
    chosen = {k: v for k, v in goal["goal_options"].items() if v in product["options"].get(k, [])}
    return webshop_reward(product, goal, chosen)[0] == 1.0


def split_goal(shop: Shop, seed: int, task: int, difficulty: Difficulty, eval_goals: int) -> dict:
    """Goal `task`: held-out (task < eval_goals) goals target held-out products, training goals the rest.
    A goal that a product of the other split would also win is drawn again (so no eval instruction text
    is a training one either: a training goal with the same text is won by its training target)."""
    held = held_out_products(len(shop.products))
    held_set = set(held)
    targets = held if task < eval_goals else [j for j in range(len(shop.products)) if j not in held_set]
    other = [p for j, p in enumerate(shop.products) if (j in held_set) != (task < eval_goals)]
    for attempt in range(100):
        goal = make_goal(shop.products, seed, task, difficulty, targets, attempt)
        # a product of another category has none of the goal's attributes, so cannot win it
        if not any(wins(p, goal) for p in other if p["category"] == goal["category"]):
            return goal
    raise ValueError(f"webshop-lite: no goal {task} that only its own split's products win "
                     f"(seed {seed}, {difficulty})")


def sep(*parts: str) -> str:
    return " [SEP] ".join(parts)


class WebShopLiteEnv:
    def __init__(self, seed: int = 0, num_products: int = 40, num_attributes: int = 1, num_options: int = 1,
                 values_per_option: int = 3, eval_goals: int = 100, train_goals: int = 1000,
                 max_steps: int = 15, obs_format: str = "raw"):
        if obs_format not in ("raw", "verl"):
            raise ValueError(f"obs_format must be 'raw' (WebShop's text) or 'verl' (verl-agent's), "
                             f"got {obs_format!r}")
        self.seed, self.max_steps, self.obs_format = seed, max_steps, obs_format
        self.difficulty = Difficulty(num_products, num_attributes, num_options, values_per_option)
        self.shop = get_shop(seed, self.difficulty)
        self.eval_targets = held_out_products(num_products)
        if not self.eval_targets:
            raise ValueError(f"webshop-lite needs num_products >= {len(KINDS) + 1} for its held-out split "
                             f"(held-out targets are products {len(KINDS)}, {len(KINDS) + 2}, ...), "
                             f"got {num_products}")
        held = set(self.eval_targets)
        self.train_targets = [j for j in range(num_products) if j not in held]
        self.eval_goals, self.train_goals = eval_goals, train_goals
        self.goal: dict | None = None
        self.done = True

    # verl-agent: goals 0-499 evaluation, 500+ training; here 0..eval_goals-1 and the next train_goals,
    # each split with its own target products (webshop_catalog's docstring)
    def tasks(self, split: str) -> list[int]:
        if split == "eval":
            return list(range(self.eval_goals))
        if split == "train":
            return list(range(self.eval_goals, self.eval_goals + self.train_goals))
        raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")

    def reset(self, task: int = 0) -> tuple[str, dict]:
        if not isinstance(task, int) or task < 0:
            raise ValueError(f"webshop-lite tasks are goal indices >= 0, got {task!r}")
        self.goal = split_goal(self.shop, self.seed, task, self.difficulty, self.eval_goals)
        self.page, self.page_num, self.keywords, self.results = "search", 1, "", []
        self.asin, self.options, self.num_searches = None, {}, 0
        self.steps, self.done = 0, False
        return self._formatted(), self._info(0.0, valid=True)

    # ---- pages (WebShop's templates, visible text only) ----

    def clickables(self) -> list[str]:
        if self.page == "results":
            prev = ["< prev"] if self.page_num > 1 else []
            return ["back to search", *prev, "next >", *(a.lower() for a in self._page_asins())]
        if self.page == "item":
            values = [v for vs in self.shop.by_asin[self.asin]["options"].values() for v in vs]
            return ["back to search", "< prev", *(s.lower() for s in SUB_PAGES), "buy now", *values]
        if self.page in SUB_PAGES:
            return ["back to search", "< prev"]
        return []

    def _page_asins(self) -> list[str]:
        return self.results[(self.page_num - 1) * PRODUCT_WINDOW: self.page_num * PRODUCT_WINDOW]

    def observation(self) -> str:
        instruction = ("Instruction:", self.goal["instruction_text"])
        if self.page == "search":
            return sep("WebShop", *instruction, "Search")
        head = (*instruction, "Back to Search")
        if self.page == "results":
            nav = (["< Prev"] if self.page_num > 1 else []) + ["Next >"]
            items = []
            for asin in self._page_asins():
                p = self.shop.by_asin[asin]
                items += [asin, p["Title"], p["Price"]]
            return sep(*head, f"Page {self.page_num} (Total results: {len(self.results)})", *nav, *items)
        p = self.shop.by_asin[self.asin]
        if self.page == "item":
            opts = [t for name, values in p["options"].items() for t in (name, *values)]
            return sep(*head, "< Prev", *opts, p["Title"], f"Price: {p['Price']}", f"Rating: {p['Rating']}",
                       *SUB_PAGES, "Buy Now")
        if self.page == "Description":
            return sep(*head, "< Prev", p["Description"])
        if self.page == "Features":
            return sep(*head, "< Prev", *p["BulletPoints"])
        if self.page == "Reviews":
            return sep(*head, "< Prev", *(t for r in p["Reviews"]
                                          for t in (f'"{r["title"]}"', str(r["score"]), r["body"])))
        return sep("Thank you for shopping with us!", "Purchased", "asin", self.asin, "options",
                   json.dumps(self.options), "Your score (min 0.0, max 1.0)", f"{self.reward}")

    def _formatted(self) -> str:
        page = self.observation()
        return verl_observation(page, self.goal["instruction_text"]) if self.obs_format == "verl" else page

    def _info(self, reward: float, valid: bool, **extra) -> dict:
        return {"instruction": self.goal["instruction_text"], "won": self.done and reward == 1.0,
                "task_score": reward, "valid_action": valid,
                "admissible_actions": admissible_actions(self.page == "search", self.clickables()),
                "page": self.page, **extra}

    # ---- transitions (WebShop's SimServer.receive) ----

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.goal is None or self.done:
            return "The episode is over; call reset.", 0.0, True, {
                "instruction": self.goal["instruction_text"] if self.goal else "", "won": False,
                "task_score": 0.0, "valid_action": False, "admissible_actions": []}
        self.steps += 1
        parsed = parse_action(action)
        error = parsed if isinstance(parsed, str) else self._apply(*parsed)
        reward = self.reward if self.page == "done" else 0.0
        self.done = self.page == "done" or self.steps >= self.max_steps
        extra = {"truncated": self.page != "done"} if self.done else {}
        if self.page == "done":
            extra["reward_info"] = self.reward_info
        if error:
            return sep(f"Invalid action: {error}", self._formatted()), 0.0, self.done, self._info(
                0.0, valid=False, **extra)
        return self._formatted(), reward, self.done, self._info(reward, valid=True, **extra)

    def _apply(self, name: str, arg: str) -> str | None:
        """Change the page; return None, or a message if the action does nothing here."""
        if name == "search":  # WebShop searches from any page, forgetting the product and its options
            self.keywords, self.results = arg, self.shop.search(arg)
            self.page, self.page_num, self.num_searches = "results", 1, self.num_searches + 1
            self.asin, self.options = None, {}
            return None
        if arg not in self.clickables():
            shown = ", ".join(self.clickables()) or "nothing (use search[keywords])"
            return f"{_show(arg)} is not clickable on this page; clickable: {shown}"
        if arg == "back to search":
            self.page, self.asin, self.options = "search", None, {}
        elif arg == "next >":
            self.page_num += 1
        elif arg == "< prev":
            if self.page == "results":
                self.page_num -= 1
            elif self.page == "item":
                self.page, self.asin, self.options = "results", None, {}
            else:
                self.page = "item"
        elif self.page == "results":  # a product link
            self.page, self.asin, self.options = "item", arg.upper(), {}
        elif arg in (s.lower() for s in SUB_PAGES):
            self.page = arg.capitalize()
        elif arg == "buy now":
            self.reward, self.reward_info = webshop_reward(self.shop.by_asin[self.asin], self.goal,
                                                           self.options)
            self.page = "done"
        else:  # an option value: it replaces the choice for its option name
            for option_name, values in self.shop.by_asin[self.asin]["options"].items():
                if arg in values:
                    self.options[option_name] = arg
        return None

    def expert_action(self) -> str:
        return expert_action(self)

    def expert_thought(self, action: str, long: bool = False) -> str:
        """A one-line reason for the expert's `action` (the expert has none), for cold-start data written as
        `<think>…</think><action>…</action>` (t2po.py); short, to fit the CPU response budget."""
        if action.startswith("search["):
            return "Search for the product the task describes."
        if action == "click[buy now]":
            return "This item fits the task, so buy it."
        if action.startswith("click[") and action[6:-1] in ("next >", "< prev", "back to search"):
            return "The target is not on this page; navigate."
        return "Open the result that best matches the task."


def expert_action(env: WebShopLiteEnv) -> str:
    """Scripted expert for cold-start data: search the goal's attributes and type, page through the
    results to the target, pick the goal's options, buy. Falls back to searching the exact title."""
    goal = env.goal
    if env.page == "search":
        target = env.shop.by_asin[goal["asin"]]
        query = f"{' '.join(goal['attributes'])} {goal['name']}" if env.num_searches == 0 else target["Title"]
        return f"search[{query.lower()}]"
    if env.page == "results":
        if goal["asin"] in env._page_asins():
            return f"click[{goal['asin'].lower()}]"
        if env._page_asins() and env.page_num * PRODUCT_WINDOW < len(env.results):
            return "click[next >]"
        return "click[back to search]"
    if env.page == "item":
        if env.asin != goal["asin"]:
            return "click[< prev]"
        for name, value in goal["goal_options"].items():
            if env.options.get(name) != value:
                return f"click[{value}]"
        return "click[buy now]"
    return "click[< prev]"  # a sub-page


def make(**options) -> WebShopLiteEnv:
    return WebShopLiteEnv(**options)
