"""The serving benchmark's workloads (`localspec bench --clients 1,8 --workload open,records,agent`):
what the clients ask, as plain chat messages every server takes the same way.

- open:    each client its own open-ended prompt, nothing repeated (the suffix cache has nothing to learn)
- records: 32 product listings (workloads/records.jsonl), each answered in one fixed six-field format
           under one system prompt and one worked example; the clients work through them as one queue, and then through the
           same 32 again on the same server (pass 2: what a server learns from pass 1)
- agent:   each client an agent loop: one system prompt with a tool list, one worked example of a loop,
           the client's task, then turns
           of a JSON tool call from the model and a fixed tool result ("Tool result: ...") as the next
           user message, the growing conversation sent again each turn

A `Conversation` is one client's requests: the first request's messages, then after each reply the
user message that follows it. The requests after the first depend on the model's replies, and so
do the same on every system that answers the same (greedy decoding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from localspec.bench import workloads as wl

CLIENT_WORKLOADS = ("open", "records", "agent")

# open-ended prompts, one per client (a client count above their number cycles them)
CLIENT_PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how the internet works to a ten-year-old.",
    "What are some good habits for staying healthy? Explain each one.",
    "Describe a day in the life of a medieval blacksmith.",
    "Give me a plan for learning a new language in six months.",
    "Why do leaves change color in the autumn?",
    "Write a letter to a friend about a trip to the mountains.",
    "What should someone know before adopting a dog?",
    "Explain the difference between weather and climate.",
    "Describe how bread is made, from wheat to loaf.",
    "Write a poem about a city at night.",
    "What are the pros and cons of electric cars?",
    "Tell me about the life cycle of a butterfly.",
    "How does a refrigerator keep food cold?",
    "Give me ideas for a rainy weekend at home.",
    "Explain what makes a good team leader.",
)
# the warm-up round's prompts: none of any workload's, so a server learns nothing from it that a workload asks
WARMUP_PROMPTS = (
    "Name three colors.", "Say hello in French.", "What is two plus two?", "Name a large animal.",
    "What day comes after Monday?", "Name a fruit that is yellow.", "What is the capital of Italy?",
    "Name a musical instrument.",
)

AGENT_TOOLS = (
    {"name": "search_products", "description": "Search the store's catalogue.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "max_price": {"type": "number"}},
                    "required": ["query"]}},
    {"name": "get_weather", "description": "The weather forecast for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"]}},
    {"name": "calculator", "description": "Evaluate an arithmetic expression.",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
    {"name": "add_to_cart", "description": "Put a product in the customer's cart.",
     "parameters": {"type": "object", "properties": {"product_id": {"type": "string"}, "quantity": {"type": "integer"}},
                    "required": ["product_id"]}},
    {"name": "finish", "description": "End the task with a short summary for the customer.",
     "parameters": {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}},
)
AGENT_SYSTEM = (
    "You are a shopping assistant that works by calling tools. The tools:\n"
    + "\n".join(json.dumps(t) for t in AGENT_TOOLS)
    + "\n\nAnswer every turn with exactly one tool call as one line of JSON and nothing else, in this form:\n"
    '{"tool": "<tool name>", "arguments": {<the arguments>}}\n'
    'Each tool call is answered with a message that starts "Tool result:". When the task is done, call finish.'
)
# one worked example between the system prompt and the client's task: a small model follows the format from it
AGENT_EXAMPLE = (
    {"role": "user", "content": "Find a desk lamp under $50 and add it to my cart."},
    {"role": "assistant", "content": '{"tool": "search_products", "arguments": {"query": "desk lamp", "max_price": 50}}'},
    {"role": "user", "content": 'Tool result: {"results": [{"product_id": "P-0907", "name": "Aurora Ceramic Table Lamp", '
                                '"price": 44.5, "rating": 4.3}]}'},
    {"role": "assistant", "content": '{"tool": "add_to_cart", "arguments": {"product_id": "P-0907", "quantity": 1}}'},
    {"role": "user", "content": 'Tool result: {"ok": true, "product_id": "P-0907", "quantity": 1, "cart_total": 44.5}'},
    {"role": "assistant", "content": '{"tool": "finish", "arguments": {"summary": "I added the Aurora Ceramic Table '
                                     'Lamp ($44.50) to your cart."}}'},
)
AGENT_TURNS = 4  # requests per client: the task, then a tool result after each of the first three replies


def _results(*results: dict) -> tuple[str, ...]:
    return tuple("Tool result: " + json.dumps(r) for r in results)


def _products(*items: tuple[str, str, float, float]) -> dict:
    return {"results": [{"product_id": i, "name": n, "price": p, "rating": r} for i, n, p, r in items]}


def _forecast(city: str, *days: tuple[str, int, int, int]) -> dict:
    return {"city": city, "forecast": [{"day": d, "high_c": hi, "low_c": lo, "rain_percent": rain}
                                       for d, hi, lo, rain in days]}


def _cart(product_id: str, quantity: int, total: float) -> dict:
    return {"ok": True, "product_id": product_id, "quantity": quantity, "cart_total": total}


def _task(task: str, *results: dict) -> tuple[str, tuple[str, ...]]:
    """A client's task and the tool results that answer its turns: `results`, then the order's summary."""
    return task, _results(*results, {"ok": True, "message": "Order summary sent."})


# (the client's task, the tool results that answer its turns in order, whatever the model called)
AGENT_TASKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    _task("I am hiking near Denver this weekend. Find a waterproof jacket under $150, check the weather there, and "
          "add the best jacket to my cart.",
          _products(("P-1042", "Stratus Rain Jacket", 98.0, 4.4), ("P-1187", "Ridge Shell Jacket", 142.5, 4.7)),
          _forecast("Denver", ("Sat", 14, 3, 60), ("Sun", 11, 1, 30)), _cart("P-1187", 1, 142.5)),
    _task("Find two yoga mats under $80, work out what two of the cheaper one cost with 8% sales tax, and add them "
          "to my cart.",
          _products(("P-2210", "CoreFlex Yoga Mat", 68.0, 4.7), ("P-2251", "Balance Cork Mat", 74.0, 4.5)),
          {"expression": "2 * 68 * 1.08", "value": 146.88}, _cart("P-2210", 2, 146.88)),
    _task("I am going to the beach in Miami on Friday. Check the forecast, then find a beach towel and sunglasses, "
          "and add the towel to my cart.",
          _forecast("Miami", ("Fri", 31, 25, 20), ("Sat", 30, 24, 40)),
          _products(("P-3305", "Dune Beach Towel", 32.0, 4.5), ("P-3390", "Coastline Polarized Sunglasses", 45.0, 4.2)),
          _cart("P-3305", 1, 32.0)),
    _task("Find a cast iron skillet and a wooden salad bowl, tell me what both cost together, and add the skillet to "
          "my cart.",
          _products(("P-4120", "Ironclad 12-Inch Skillet", 39.95, 4.8), ("P-4188", "Tidewater Acacia Bowl", 38.0, 4.8)),
          {"expression": "39.95 + 38.0", "value": 77.95}, _cart("P-4120", 1, 39.95)),
    _task("I need a carry-on suitcase under $200 for a trip to Seattle next week. Check the weather there too, and "
          "add the suitcase to my cart.",
          _products(("P-5012", "Voyager Hardshell Carry-On", 179.99, 4.7),
                    ("P-5077", "Metro Softside Carry-On", 129.0, 4.3)),
          _forecast("Seattle", ("Mon", 12, 7, 80), ("Tue", 13, 8, 70)), _cart("P-5012", 1, 179.99)),
    _task("Find wireless earbuds under $100 and a phone case, work out the total with a $10 coupon, and add the "
          "earbuds to my cart.",
          _products(("P-6230", "Echo Wireless Earbuds", 59.99, 4.0), ("P-6301", "Armor Slim Case", 21.99, 4.5)),
          {"expression": "59.99 + 21.99 - 10", "value": 71.98}, _cart("P-6230", 1, 59.99)),
    _task("Look for solar string lights for my patio in Phoenix, check whether it will rain there this week, and add "
          "two sets to my cart.",
          _products(("P-7144", "Lumen Solar String Lights", 42.99, 4.5), ("P-7150", "Glow Solar Lanterns", 36.5, 4.1)),
          _forecast("Phoenix", ("Wed", 35, 22, 0), ("Thu", 36, 23, 5)), _cart("P-7144", 2, 85.98)),
    _task("Find a fountain pen and a leather belt as a gift, tell me what both cost, and add the pen to my cart.",
          _products(("P-8020", "Scribe Fountain Pen", 72.0, 4.6), ("P-8066", "Heritage Leather Belt", 49.0, 4.7)),
          {"expression": "72.0 + 49.0", "value": 121.0}, _cart("P-8020", 1, 72.0)),
)


@dataclass(frozen=True)
class Conversation:
    """One client's requests: `messages` first, then after each reply the user message of `followups`
    that follows it (as many requests as followups + 1)."""

    id: str
    messages: tuple[dict[str, str], ...]
    followups: tuple[str, ...] = ()

    @property
    def turns(self) -> int:
        return len(self.followups) + 1

    def request(self, replies: Sequence[str]) -> list[dict[str, str]]:
        """The messages of request number len(replies): the first request's, then each earlier reply
        (as the assistant's) and the user message that followed it."""
        if len(replies) >= self.turns:
            raise ValueError(f"{self.id}: {self.turns} requests, not {len(replies) + 1}")
        messages = [dict(m) for m in self.messages]
        for reply, followup in zip(replies, self.followups):
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": followup}]
        return messages

    def to_dict(self) -> dict:
        return {"id": self.id, "messages": [dict(m) for m in self.messages], "followups": list(self.followups)}


@dataclass(frozen=True)
class Workload:
    """What the clients of one pass ask: `conversations`, one queue the clients work through (each
    takes the next when it is done with one); `passes`: times the same queue runs on the same server."""

    name: str
    conversations: tuple[Conversation, ...]
    max_tokens: int
    ctx_per_slot: int  # context each server slot needs for the longest request and its answer
    passes: int = 1

    @property
    def repeats(self) -> int:
        """Conversations the same as one before them in the queue (more clients than tasks)."""
        return len(self.conversations) - len({json.dumps(c.to_dict()["messages"] + [c.followups])
                                              for c in self.conversations})

    def to_dict(self) -> dict:
        return {"name": self.name, "max_tokens": self.max_tokens, "ctx_per_slot": self.ctx_per_slot,
                "passes": self.passes, "conversations": [c.to_dict() for c in self.conversations]}


def open_workload(n_clients: int, rep: int = 0, max_tokens: int | None = None) -> Workload:
    """N clients, each its own open-ended prompt (repetition `rep` starts further along the list)."""
    ids = [(rep * n_clients + i) % len(CLIENT_PROMPTS) for i in range(n_clients)]
    return Workload("open", tuple(Conversation(f"open-{i + 1:02d}", ({"role": "user", "content": CLIENT_PROMPTS[i]},))
                                  for i in ids), max_tokens or 256, ctx_per_slot=1024)


def records_workload(max_listings: int | None = None, max_tokens: int | None = None) -> Workload:
    """The product listings (workloads/records.jsonl), twice on the same server."""
    prompts = wl.load(["records"], max_prompts=max_listings)
    return Workload("records", tuple(Conversation(p.id, p.messages) for p in prompts),
                    max_tokens or prompts[0].max_tokens, ctx_per_slot=1024, passes=2)


def agent_workload(n_clients: int, turns: int = AGENT_TURNS, max_tokens: int | None = None) -> Workload:
    """N clients, each an agent loop of `turns` requests (a client count above the tasks' cycles them)."""
    if not 1 <= turns <= 1 + min(len(results) for _, results in AGENT_TASKS):
        raise ValueError(f"agent: 1 to {1 + len(AGENT_TASKS[0][1])} turns")
    conversations = []
    for i in range(n_clients):
        task, results = AGENT_TASKS[i % len(AGENT_TASKS)]
        messages = ({"role": "system", "content": AGENT_SYSTEM}, *AGENT_EXAMPLE, {"role": "user", "content": task})
        conversations.append(Conversation(f"agent-{i + 1:02d}", messages, results[:turns - 1]))
    return Workload("agent", tuple(conversations), max_tokens or 96, ctx_per_slot=2048)


def build(name: str, n_clients: int, rep: int = 0, *, max_tokens: int | None = None, max_prompts: int | None = None,
          turns: int = AGENT_TURNS) -> Workload:
    """The workload `name` for N clients' repetition `rep` (`max_prompts`: at most that many listings
    of records)."""
    if name == "open":
        return open_workload(n_clients, rep, max_tokens)
    if name == "records":
        return records_workload(max_prompts, max_tokens)
    if name == "agent":
        return agent_workload(n_clients, turns, max_tokens)
    raise ValueError(f"--clients workloads: {', '.join(CLIENT_WORKLOADS)} (not {name!r})")
