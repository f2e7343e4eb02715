# The trainer image of trainer-job.yaml and trainer-jobset.yaml: marduk:dev (the image of
# docker-compose.yml, built from the repository's Dockerfile) plus jax for
# examples/jax_trainer.py. A real trainer image needs the same two things: marduk
# (`pip install 'marduk[jax]'`, for `marduk agent run` and the agent library) and the training code.
#   docker build -t marduk:dev . && docker build -t marduk-trainer:dev -f deploy/k8s/trainer.Dockerfile .
FROM marduk:dev
# CPU jax, enough for the example; on NVIDIA nodes install 'jax[cuda12]' instead.
RUN pip install --no-cache-dir 'jax>=0.4.30'
