"""A user's own DDP training script, not torchrig's payload: what `launch --workdir` runs in
the tests. Its package (trainer/) comes from the project's folder, its dependency (six) from
the job environment torchrig builds from requirements.txt."""

from trainer.run import main

if __name__ == "__main__":
    main()
