#!/usr/bin/env bash
# The other torch releases that clusters and the GPU machine run, each in its own virtual
# environment under $VENVS (default /tmp/ddp-older-torch; reused when present): test_gather.py
# under torchrun at 2 and 3 ranks, and test_train.py's exit test, twice, because the exit hang it
# guards against came in about 1 launch of 5 (docs/testing.md). torch 2.3 has wheels for Python 3.8
# to 3.12 only: CI's python3 is 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
venvs=${VENVS:-/tmp/ddp-older-torch}

install_release() {  # torch version, then the rest of what its environment needs
    local version=$1 venv=$venvs/torch-$1 began=$SECONDS
    shift
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
    # What its tests import besides torch: not requirements-test.txt's engines, for test_recipes.py.
    "$venv/bin/python" -m pip install -q "torch==$version" "$@" "pytest>=8" "pytest-timeout>=2.3" \
        "pytest-xdist>=3" pyyaml
    echo "== torch $version installed: $((SECONDS - began)) s"
}

check_release() {  # torch version
    local version=$1 venv=$venvs/torch-$1 began=$SECONDS
    echo "== torch $version"
    # test_gather.py has a test per check and world size, named [ranks-check], and one for each launch's exit:
    # those at 2 and 3 ranks.
    local gather="test_torchrun_gloo_cpu[2- or test_torchrun_gloo_cpu[3- or test_torchrun_gloo_cpu_exit[2]"
    gather+=" or test_torchrun_gloo_cpu_exit[3]"
    # -n 0: one test at a time. Two at once took longer here (63 s for 57): each keeps 2 cores busy.
    PATH=$venv/bin:$PATH python -m pytest -q -n 0 -p no:cacheprovider test_gather.py -k "$gather"
    for _ in 1 2; do
        PATH=$venv/bin:$PATH python -m pytest -q -n 0 -p no:cacheprovider \
            tests/test_train.py::test_every_rank_exits_after_train_resume_and_evaluate
    done
    echo "== torch $version: $((SECONDS - began)) s"
}

# install: the environments alone (.ci/run does it while the main tests run); check: the tests alone.
if [[ ${1:-all} != check ]]; then
    install_release 2.3.1 torchvision==0.18.1 "numpy<2"  # torch 2.3 was built against numpy 1
    install_release 2.11.0 torchvision==0.26.0           # the GPU machine's release
    # The newest, with its new NCCL backend: above the cap of pip's global constraints file here.
    PIP_CONSTRAINT=/dev/null install_release 2.15.0 torchvision==0.29.2
fi
if [[ ${1:-all} != install ]]; then
    check_release 2.3.1
    check_release 2.11.0
    check_release 2.15.0
fi
