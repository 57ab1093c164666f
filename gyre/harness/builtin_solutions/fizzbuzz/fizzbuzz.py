def fizzbuzz(n: int) -> str:
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    word = ("Fizz" if n % 3 == 0 else "") + ("Buzz" if n % 5 == 0 else "")
    return word or str(n)


def fizzbuzz_range(start: int, stop: int) -> list[str]:
    return [fizzbuzz(i) for i in range(start, stop)]
