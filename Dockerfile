# tether's container image: a static binary on distroless, as a non-root user.
#   docker build -t tether:dev .
# The product only (serve, config, sessions, audit): .dockerignore leaves the
# lab out of the build context; the lab has its own image (lab/Dockerfile).
# Run it with a configuration mounted at /etc/tether/tether.toml (the
# Kubernetes Deployment in deploy/k8s mounts its ConfigMap there).
# deploy/image/image_test.go builds the same binary the same way and runs it
# from an empty directory, since no image is built in CI.

FROM golang:1.26.8-bookworm AS build
WORKDIR /src
# The product's module alone: the workspace (go.work) also names ./lab and
# ./e2e, which .dockerignore leaves out of this context.
ENV GOWORK=off
# Dependencies first: this layer is reused until go.mod or go.sum change.
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# No cgo: the binary needs no libc, so it runs on an image without one.
ENV CGO_ENABLED=0
RUN go build -trimpath -ldflags "-s -w" -o /out/tether ./cmd/tether

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/tether /tether
# distroless's nonroot user.
USER 65532:65532
# ext_proc gRPC, xDS (ADS) gRPC, admin HTTP (/healthz, /readyz, /metrics):
# the ports of deploy/k8s/configmap.yaml and deploy/compose/tether.toml
# (xDS: compose only; the Kubernetes one turns the ADS server off).
EXPOSE 50051 18000 8090
ENTRYPOINT ["/tether", "serve", "--config", "/etc/tether/tether.toml"]
