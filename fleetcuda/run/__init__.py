"""Running a plan: the engine, target locks, the build cache, ABI fingerprints, doctor, schedules."""
