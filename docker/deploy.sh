#!/usr/bin/env bash
# p2pswarm on Docker Swarm, one thin step at a time; each step prints the docker command
# it runs. `docker/deploy.sh help` lists them; docker/README.md walks a whole deployment.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
STACK=${STACK:-p2pswarm}
SECRET=p2pswarm_token                     # the Docker secret the stack reads the token from
PORT=7782                                 # p2pswarm's default port (p2pswarm/config.py)
TOKEN_FILE=${P2PSWARM_TOKEN_FILE:-${XDG_CONFIG_HOME:-$HOME/.config}/p2pswarm/token}
ADMIN_HOME=${P2PSWARM_ADMIN_HOME:-${XDG_CONFIG_HOME:-$HOME/.config}/p2pswarm/admin}
INVITE_TTL=${INVITE_TTL:-24h}             # how long the invitation in the secret admits
ISSUER_SECRET=p2pswarm_issuer             # the issuer bundle, for worker-server only
ISSUER_FILE=${P2PSWARM_ISSUER_FILE:-${XDG_CONFIG_HOME:-$HOME/.config}/p2pswarm/issuer.json}
ISSUER_TTL=${ISSUER_TTL:-30d}             # how long that bundle may admit fellows
PLATFORMS=${PLATFORMS:-linux/amd64,linux/arm64}
VARIANTS=${VARIANTS:-cpu cuda}
CUDA_BASE=${CUDA_BASE:-nvidia/cuda:12.4.1-runtime-ubuntu22.04}
BUILDER=${BUILDER:-p2pswarm}
KINDS="server desktop laptop rpi"
SERVICES="worker-server worker-desktop worker-laptop worker-rpi worker-gpu"
MAX_SEEDS=5

usage() {
    cat <<EOF
usage: docker/deploy.sh COMMAND

  init [ADVERTISE-ADDR]          make this machine a swarm manager (docker swarm init)
  join TOKEN MANAGER-IP:2377     join this machine to the swarm (TOKEN: docker swarm
                                 join-token -q worker, on the manager; "-" reads it from stdin)
  label NODE server|desktop|laptop|rpi
                                 say what a machine is; the stack places fellows by it
  build                          build the images: cpu for $PLATFORMS, cuda for linux/amd64
  push                           build and push them to \$REGISTRY (REGISTRY=host:port required)
  deploy                         make the join-token secret and the issuer secret if missing,
                                 then deploy the stack with one fellow per labelled machine
  status                         nodes, services, and where each fellow runs
  logs [SERVICE|leader]          recent logs of every service, or follow one; "leader"
                                 follows the fellow that leads now (it coordinates: there
                                 is no coordinator service)
  scale SERVICE N                run N fellows of a service (one per machine at most)
  help                           this text

Services: $SERVICES
The p2pswarm join token lives in $TOKEN_FILE (P2PSWARM_TOKEN_FILE to change; made on
first use) and reaches the fellows only as the Docker secret $SECRET: it is never passed
on a command line. The swarm's admin key stays on this machine, in $ADMIN_HOME
(P2PSWARM_ADMIN_HOME); the fellows of worker-server get an issuer bundle it delegated
(the secret $ISSUER_SECRET, for ISSUER_TTL=$ISSUER_TTL) and admit the others with it.
Environment: REGISTRY, STACK ($STACK), PLATFORMS, VARIANTS ($VARIANTS), CUDA_BASE; for
deploy also SERVER_REPLICAS, DESKTOP_REPLICAS, LAPTOP_REPLICAS, RPI_REPLICAS, GPU_REPLICAS
(default: the machines labelled so) and RPI_MEMORY (3G).
EOF
}

die() {
    printf 'deploy.sh: %s\n' "$*" >&2
    exit 2
}

run() {  # print the command, then run it
    printf '+ %s\n' "$*" >&2
    "$@"
}

need() {  # need COUNT "what is missing" ARGS...
    local count=$1 usage_line=$2
    shift 2
    [ "$#" -ge "$count" ] || die "missing argument: $usage_line"
    [ "$#" -le "$count" ] || die "too many arguments: $usage_line"
}

image() {  # the image's name, untagged, with the registry in front if there is one
    printf '%s\n' "${REGISTRY:+${REGISTRY%/}/}p2pswarm"
}

# --- the p2pswarm join token ----------------------------------------------------------

token_from_json() {  # the "token" field of `p2pswarm init --json`
    sed -n 's/^ *"token": *"\([^"]*\)".*/\1/p'
}

make_token() {  # make_token [USES]
    # A new swarm's invitation (USES fellows, for INVITE_TTL), written to TOKEN_FILE (mode
    # 600) through a pipe, never an argument. The swarm's admin key stays in ADMIN_HOME on
    # this machine (`p2pswarm invite --home ADMIN_HOME` makes more), made by p2pswarm if
    # it is installed here, else by the image (once built) with ADMIN_HOME mounted.
    mkdir -p "$(dirname "$TOKEN_FILE")"
    (umask 077 && mkdir -p "$ADMIN_HOME")
    local uses=${1:-10}
    if command -v p2pswarm >/dev/null 2>&1; then
        printf '+ p2pswarm init --home %s --uses %s --ttl %s --json | (the token) > %s\n' \
            "$ADMIN_HOME" "$uses" "$INVITE_TTL" "$TOKEN_FILE" >&2
        (umask 077 && p2pswarm init --home "$ADMIN_HOME" --uses "$uses" --ttl "$INVITE_TTL" \
            --json | token_from_json > "$TOKEN_FILE") || true
    elif [ -n "${REGISTRY:-}" ] || docker image inspect "$(image):cpu" >/dev/null 2>&1; then
        printf '+ docker run --rm --network none --user %s -v %s:/admin --entrypoint p2pswarm %s init --home /admin --uses %s --ttl %s --json | (the token) > %s\n' \
            "$(id -u):$(id -g)" "$ADMIN_HOME" "$(image):cpu" "$uses" "$INVITE_TTL" "$TOKEN_FILE" >&2
        (umask 077 && docker run --rm --network none --user "$(id -u):$(id -g)" \
            -v "$ADMIN_HOME:/admin" --entrypoint p2pswarm "$(image):cpu" \
            init --home /admin --uses "$uses" --ttl "$INVITE_TTL" --json \
            | token_from_json > "$TOKEN_FILE") || true
    else
        return 1
    fi
    [ -s "$TOKEN_FILE" ] || die "could not make a join token (see above); put one in $TOKEN_FILE"
    printf 'A new p2pswarm swarm; its join token is in %s (keep it secret).\n' "$TOKEN_FILE" >&2
}

ensure_secret() {  # ensure_secret [USES]
    # The token as the Docker secret, from TOKEN_FILE on stdin (`docker secret create
    # NAME -`). Returns 1 if there is no token yet and none can be made.
    if docker secret inspect "$SECRET" >/dev/null 2>&1; then
        printf 'The secret %s is there already.\n' "$SECRET" >&2
        return 0
    fi
    if [ ! -s "$TOKEN_FILE" ]; then
        make_token "${1:-}" || return 1
    fi
    printf '+ docker secret create %s - < %s\n' "$SECRET" "$TOKEN_FILE" >&2
    docker secret create "$SECRET" - < "$TOKEN_FILE" >/dev/null
}

make_issuer() {
    # An issuer bundle the admin key in ADMIN_HOME delegates for ISSUER_TTL, written to
    # ISSUER_FILE (mode 600) through a pipe: the admin key itself never leaves ADMIN_HOME.
    [ -e "$ADMIN_HOME/admin.json" ] || return 1
    if command -v p2pswarm >/dev/null 2>&1; then
        printf '+ p2pswarm delegate --home %s --ttl %s --out - > %s\n' \
            "$ADMIN_HOME" "$ISSUER_TTL" "$ISSUER_FILE" >&2
        (umask 077 && p2pswarm delegate --home "$ADMIN_HOME" --ttl "$ISSUER_TTL" --out - \
            > "$ISSUER_FILE") || true
    else
        printf '+ docker run --rm --network none --user %s -v %s:/admin --entrypoint p2pswarm %s delegate --home /admin --ttl %s --out - > %s\n' \
            "$(id -u):$(id -g)" "$ADMIN_HOME" "$(image):cpu" "$ISSUER_TTL" "$ISSUER_FILE" >&2
        (umask 077 && docker run --rm --network none --user "$(id -u):$(id -g)" \
            -v "$ADMIN_HOME:/admin" --entrypoint p2pswarm "$(image):cpu" \
            delegate --home /admin --ttl "$ISSUER_TTL" --out - > "$ISSUER_FILE") || true
    fi
    [ -s "$ISSUER_FILE" ] || die "could not make an issuer bundle (see above)"
}

ensure_issuer_secret() {
    # The issuer bundle as the Docker secret worker-server reads (P2PSWARM_ISSUER_FILE):
    # its fellows admit the stack's other fellows, so no container ever holds the admin key.
    if docker secret inspect "$ISSUER_SECRET" >/dev/null 2>&1; then
        printf 'The secret %s is there already.\n' "$ISSUER_SECRET" >&2
        return 0
    fi
    if [ ! -s "$ISSUER_FILE" ]; then
        make_issuer || return 1
    fi
    printf '+ docker secret create %s - < %s\n' "$ISSUER_SECRET" "$ISSUER_FILE" >&2
    docker secret create "$ISSUER_SECRET" - < "$ISSUER_FILE" >/dev/null
}

# --- where the fellows find each other -------------------------------------------------

node_addr() {  # a node's address in the swarm (a manager may say 0.0.0.0 there)
    local addr
    addr=$(docker node inspect --format '{{.Status.Addr}}' "$1")
    if [ "$addr" = "0.0.0.0" ] || [ -z "$addr" ]; then
        addr=$(docker node inspect --format '{{.ManagerStatus.Addr}}' "$1")
        addr=${addr%:*}
    fi
    printf '%s\n' "$addr"
}

labelled() {  # the ids of the nodes labelled KIND
    docker node ls -q --filter "node.label=p2pswarm.kind=$1"
}

seeds() {  # up to MAX_SEEDS labelled nodes as HOST:PORT,HOST:PORT (servers first: wired)
    local kind id out="" count=0
    for kind in $KINDS; do
        for id in $(labelled "$kind"); do
            [ "$count" -lt "$MAX_SEEDS" ] || break 2
            out="${out:+$out,}$(node_addr "$id"):$PORT"
            count=$((count + 1))
        done
    done
    printf '%s\n' "$out"
}

gpu_nodes() {  # how many nodes advertise the generic resource "gpu"
    local ids
    ids=$(docker node ls -q)
    [ -n "$ids" ] || { echo 0; return; }
    # shellcheck disable=SC2086
    docker node inspect --format '{{range .Description.Resources.GenericResources}}{{if .NamedResourceSpec}}{{.NamedResourceSpec.Kind}} {{end}}{{if .DiscreteResourceSpec}}{{.DiscreteResourceSpec.Kind}} {{end}}{{end}}' $ids \
        | grep -cw gpu || true
}

# --- commands --------------------------------------------------------------------------

cmd_init() {
    [ "$#" -le 1 ] || die "too many arguments: init [ADVERTISE-ADDR]"
    run docker swarm init ${1:+--advertise-addr "$1"}
    if ! ensure_secret; then
        printf 'No join token yet: deploy.sh deploy makes one with the image once it is built.\n' >&2
    fi
    printf 'Next, on every other machine: docker/deploy.sh join TOKEN %s:2377\n' "${1:-THIS-MACHINE}" >&2
    printf '(TOKEN: docker swarm join-token -q worker)\n' >&2
}

cmd_join() {
    need 2 "join TOKEN MANAGER-IP:2377" "$@"
    local token=$1 manager=$2
    if [ "$token" = "-" ]; then
        IFS= read -r token || true
    fi
    [ -n "$token" ] || die "join: the token is empty (docker swarm join-token -q worker, on the manager)"
    case "$manager" in
        *:*) ;;
        *) die "join: give the manager as HOST:PORT, e.g. 192.168.1.10:2377" ;;
    esac
    # docker takes the swarm's join token only as an argument; print it masked
    printf '+ docker swarm join --token %s… %s\n' "${token:0:12}" "$manager" >&2
    docker swarm join --token "$token" "$manager"
}

cmd_label() {
    need 2 "label NODE server|desktop|laptop|rpi" "$@"
    case " $KINDS " in
        *" $2 "*) ;;
        *) die "label: $2 is not one of: server desktop laptop rpi" ;;
    esac
    run docker node update --label-add "p2pswarm.kind=$2" "$1"
}

ensure_builder() {  # a BuildKit builder that can build for several platforms at once
    if ! docker buildx inspect "$BUILDER" >/dev/null 2>&1; then
        run docker buildx create --name "$BUILDER" --driver docker-container
    fi
}

build_variants() {  # build_variants [--push]
    ensure_builder
    local variant output=("$@")
    if [ "${#output[@]}" -eq 0 ] && [ "${PLATFORMS#*,}" = "$PLATFORMS" ]; then
        output=(--load)  # one platform: into the local image store
    fi
    for variant in $VARIANTS; do
        case "$variant" in
            cpu)
                run docker buildx build --builder "$BUILDER" --platform "$PLATFORMS" \
                    -f "$HERE/Dockerfile" -t "$(image):cpu" ${output[@]+"${output[@]}"} "$REPO" ;;
            cuda)
                run docker buildx build --builder "$BUILDER" --platform linux/amd64 \
                    -f "$HERE/Dockerfile" --build-arg "BASE=$CUDA_BASE" \
                    --build-arg TORCH_INDEX=cuda -t "$(image):cuda" \
                    ${output[@]+"${output[@]}"} "$REPO" ;;
            *) die "VARIANTS: $variant is not cpu or cuda" ;;
        esac
    done
}

cmd_build() {
    need 0 "build" "$@"
    build_variants
    if [ "${PLATFORMS#*,}" != "$PLATFORMS" ]; then
        printf 'Built for %s; the images stay in the build cache: deploy.sh push sends them.\n' \
            "$PLATFORMS" >&2
    fi
}

cmd_push() {
    need 0 "push" "$@"
    [ -n "${REGISTRY:-}" ] || die "push: set REGISTRY, e.g. REGISTRY=registry.lan:5000 docker/deploy.sh push"
    build_variants --push
}

cmd_deploy() {
    need 0 "deploy" "$@"
    local kind var fellows=0
    P2PSWARM_SEEDS=$(seeds)
    [ -n "$P2PSWARM_SEEDS" ] || die "deploy: no machine is labelled yet: docker/deploy.sh label NODE server|desktop|laptop|rpi"
    export P2PSWARM_SEEDS
    export P2PSWARM_IMAGE=${P2PSWARM_IMAGE:-$(image)}
    for kind in $KINDS; do  # one fellow on each labelled machine, unless set already
        var="$(printf '%s' "$kind" | tr '[:lower:]' '[:upper:]')_REPLICAS"
        if [ -z "${!var:-}" ]; then
            printf -v "$var" '%s' "$(labelled "$kind" | grep -c . || true)"
        fi
        export "${var?}"
        fellows=$((fellows + ${!var}))
    done
    export GPU_REPLICAS=${GPU_REPLICAS:-$(gpu_nodes)}
    fellows=$((fellows + GPU_REPLICAS))
    # the invitation admits as many fellows as the stack runs, for INVITE_TTL
    ensure_secret "$fellows" || die "deploy: no join token: build the image first (deploy.sh build), install p2pswarm here, or put a token in $TOKEN_FILE"
    ensure_issuer_secret || die "deploy: no issuer bundle: $ADMIN_HOME holds no admin key; run \`p2pswarm delegate --home ADMIN-HOME --out $ISSUER_FILE\` where the admin key is"
    # shellcheck disable=SC2153  # the *_REPLICAS were set just above, by name
    printf 'seeds %s; fellows: %s server, %s desktop, %s laptop, %s rpi, %s gpu\n' \
        "$P2PSWARM_SEEDS" "$SERVER_REPLICAS" "$DESKTOP_REPLICAS" "$LAPTOP_REPLICAS" \
        "$RPI_REPLICAS" "$GPU_REPLICAS" >&2
    run docker stack deploy --with-registry-auth -c "$HERE/stack.yml" "$STACK"
}

cmd_status() {
    need 0 "status" "$@"
    run docker node ls --format 'table {{.Hostname}}\t{{.Status}}\t{{.Availability}}\t{{.ManagerStatus}}'
    run docker stack services "$STACK"
    run docker stack ps --filter desired-state=running "$STACK"
}

service_name() {  # worker-rpi or p2pswarm_worker-rpi -> p2pswarm_worker-rpi
    local name=${1#"$STACK"_}
    case " $SERVICES " in
        *" $name "*) printf '%s_%s\n' "$STACK" "$name" ;;
        *) die "no service $1: use one of $SERVICES (or leader, for logs)" ;;
    esac
}

# The name of the fellow that leads, as a fellow of the stack on this machine sees it.
leader_name() {
    local container
    container=$(docker ps -q --filter "label=com.docker.stack.namespace=$STACK" | head -n 1)
    [ -n "$container" ] || die "logs leader: no fellow of $STACK runs on this machine to ask \
who leads; run it on a machine that runs one (deploy.sh status shows where they run)"
    local ask='import json, subprocess; out = subprocess.run(["p2pswarm", "status", "--json"],
capture_output=True, text=True).stdout; print((json.loads(out or "{}").get("leader") or {})
.get("name") or "")'
    docker exec "$container" python -c "${ask//$'\n'/ }"
}

# The running task of fellow NAME: the stack names a fellow by its machine's hostname,
# with -gpu for the worker-gpu service.
fellow_task() {
    local id node name
    while read -r id node name; do
        case "$name" in
            "${STACK}_worker-gpu."*) [ "$1" = "$node-gpu" ] && { echo "$id"; return; } ;;
            *) [ "$1" = "$node" ] && { echo "$id"; return; } ;;
        esac
    done < <(docker stack ps --filter desired-state=running \
                 --format '{{.ID}} {{.Node}} {{.Name}}' "$STACK")
    die "logs leader: $1 leads, but no running task of $STACK is on a machine of that name"
}

cmd_logs() {
    [ "$#" -le 1 ] || die "too many arguments: logs [SERVICE|leader]"
    local service
    if [ "${1-}" = leader ] || [ "${1-}" = coordinator ]; then
        local name task
        name=$(leader_name)
        [ -n "$name" ] || die "logs leader: the swarm has no leader right now (p2pswarm status \
inside a fellow says why); try again in a few seconds"
        echo "the leader is $name (it coordinates the swarm; there is no coordinator service)" >&2
        task=$(fellow_task "$name")
        run docker service logs --follow --tail 100 "$task"
        return
    fi
    if [ "$#" -eq 1 ]; then
        service=$(service_name "$1")
        run docker service logs --follow --tail 100 "$service"
        return
    fi
    for service in $SERVICES; do
        run docker service logs --tail 20 "${STACK}_$service" || true
    done
}

cmd_scale() {
    need 2 "scale SERVICE N" "$@"
    local service
    service=$(service_name "$1")
    case "$2" in
        ''|*[!0-9]*) die "scale: N must be a whole number, not $2" ;;
    esac
    run docker service scale "$service=$2"
}

main() {
    [ "$#" -ge 1 ] || { usage >&2; exit 2; }
    local command=$1
    shift
    case "$command" in
        init) cmd_init "$@" ;;
        join) cmd_join "$@" ;;
        label) cmd_label "$@" ;;
        build) cmd_build "$@" ;;
        push) cmd_push "$@" ;;
        deploy) cmd_deploy "$@" ;;
        status) cmd_status "$@" ;;
        logs) cmd_logs "$@" ;;
        scale) cmd_scale "$@" ;;
        help|-h|--help) usage ;;
        *) die "unknown command $command: docker/deploy.sh help lists them" ;;
    esac
}

main "$@"
