"""EngineSlots grants a freed slot to the lowest priority value first (the engine's priority policy, applied while
requests wait in the API process), then by the fairness rule between users."""

import asyncio

from launch.api_server.fairness import EngineSlots


def test_a_freed_slot_goes_to_the_lowest_priority_value_then_to_the_user_with_fewest_in_the_engine():
    async def go() -> list[str]:
        slots = EngineSlots(1)
        await slots.acquire("holder")
        order: list[str] = []

        async def wait(user: str, priority: int, name: str) -> None:
            await slots.acquire(user, priority)
            order.append(name)

        tasks = [asyncio.create_task(wait(u, p, n)) for u, p, n in
                 [("a", 5, "a5"), ("b", 0, "b0"), ("a", 0, "a0"), ("c", 9, "c9"), ("b", 5, "b5")]]
        await asyncio.sleep(0)
        for _ in tasks:
            slots.release(order[-1][0] if order else "holder")
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    # priority 0 first (a before b: tied, neither holds a slot, a has waited longest), then 5, then 9
    assert asyncio.run(go()) == ["a0", "b0", "a5", "b5", "c9"]
