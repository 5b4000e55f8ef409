// Package image_test checks the container image recipe (the Dockerfile and
// .dockerignore at the repository root) without a container runtime: no
// image is built on these machines. It reads the Dockerfile, builds the
// binary the way its build stage does from the files .dockerignore lets
// into the build context, checks the binary is statically linked (the final
// image has no libc), and runs it the way the image's ENTRYPOINT does from
// a directory holding nothing but the binary and its configuration.
package image_test

import (
	"bufio"
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/testenv"
)

const root = "../.."

// stage is one FROM … section of a Dockerfile.
type stage struct {
	base, name string
	env        map[string]string
	runs       []string
	copies     [][]string // COPY's words, flags included
	user       string
	expose     []string
	entrypoint []string
}

// parseDockerfile reads the instructions the checks need; continuation
// lines are joined and comments dropped.
func parseDockerfile(data string) ([]*stage, error) {
	var lines []string
	var cur strings.Builder
	for _, l := range strings.Split(data, "\n") {
		t := strings.TrimSpace(l)
		if cur.Len() == 0 && (t == "" || strings.HasPrefix(t, "#")) {
			continue
		}
		if s, ok := strings.CutSuffix(t, `\`); ok {
			cur.WriteString(s + " ")
			continue
		}
		cur.WriteString(t)
		lines = append(lines, cur.String())
		cur.Reset()
	}
	var stages []*stage
	for _, l := range lines {
		instr, args, _ := strings.Cut(l, " ")
		instr, args = strings.ToUpper(instr), strings.TrimSpace(args)
		if instr == "FROM" {
			f := strings.Fields(args)
			s := &stage{base: f[0], env: map[string]string{}}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				s.name = f[2]
			}
			stages = append(stages, s)
			continue
		}
		if len(stages) == 0 {
			if instr == "ARG" {
				continue
			}
			return nil, fmt.Errorf("%s before the first FROM", instr)
		}
		s := stages[len(stages)-1]
		switch instr {
		case "ENV":
			for _, kv := range strings.Fields(args) {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					return nil, fmt.Errorf("ENV %s: use the KEY=value form", args)
				}
				s.env[k] = strings.Trim(v, `"`)
			}
		case "RUN":
			s.runs = append(s.runs, args)
		case "COPY":
			s.copies = append(s.copies, strings.Fields(args))
		case "USER":
			s.user = args
		case "EXPOSE":
			s.expose = append(s.expose, strings.Fields(args)...)
		case "ENTRYPOINT":
			if err := json.Unmarshal([]byte(args), &s.entrypoint); err != nil {
				return nil, fmt.Errorf("ENTRYPOINT %s: want the exec (JSON) form: %w", args, err)
			}
		}
	}
	if len(stages) == 0 {
		return nil, errors.New("no FROM")
	}
	return stages, nil
}

// words splits a shell command line into words: quotes group, and are
// removed. Enough for the build line; no expansion.
func words(s string) ([]string, error) {
	var out []string
	var w strings.Builder
	in, quote := false, rune(0)
	for _, r := range s {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			w.WriteRune(r)
		case r == '"' || r == '\'':
			quote, in = r, true
		case r == ' ' || r == '\t':
			if in {
				out = append(out, w.String())
				w.Reset()
				in = false
			}
		default:
			w.WriteRune(r)
			in = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unbalanced quote in %q", s)
	}
	if in {
		out = append(out, w.String())
	}
	return out, nil
}

// image is what the tests read from the Dockerfile and the manifests.
type image struct {
	build, final *stage
	buildArgs    []string // go build's arguments, -o and its value removed
	buildEnv     []string // the build stage's ENV, CGO_ENABLED always set
	binary       string   // where the final stage puts the binary
	deployment   *appsv1.Deployment
	configMap    *corev1.ConfigMap
	cfg          config.Config // the ConfigMap's tether.toml
}

var goBuild = regexp.MustCompile(`(?:^|&&|;)\s*((?:[A-Z_]+=\S+\s+)*)go build (.*?)(?:&&|;|$)`)

func readImage(t *testing.T) *image {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	stages, err := parseDockerfile(string(data))
	if err != nil {
		t.Fatalf("Dockerfile: %v", err)
	}
	if len(stages) < 2 {
		t.Fatalf("Dockerfile: %d stage(s), want a build stage and a final stage", len(stages))
	}
	im := &image{final: stages[len(stages)-1]}

	// The final stage copies the binary from a build stage.
	for _, c := range im.final.copies {
		from := ""
		var rest []string
		for _, w := range c {
			if v, ok := strings.CutPrefix(w, "--from="); ok {
				from = v
			} else if !strings.HasPrefix(w, "--") {
				rest = append(rest, w)
			}
		}
		if from == "" || len(rest) != 2 {
			continue
		}
		for _, s := range stages[:len(stages)-1] {
			if s.name == from {
				im.build, im.binary = s, rest[1]
				for _, run := range s.runs {
					m := goBuild.FindStringSubmatch(run)
					if m == nil {
						continue
					}
					args, err := words(m[2])
					if err != nil {
						t.Fatalf("Dockerfile: RUN %s: %v", run, err)
					}
					out := ""
					for i := 0; i < len(args); i++ {
						if args[i] == "-o" && i+1 < len(args) {
							out = args[i+1]
							i++
							continue
						}
						im.buildArgs = append(im.buildArgs, args[i])
					}
					if out != rest[0] {
						t.Fatalf("Dockerfile: go build writes %q, the final stage copies %q", out, rest[0])
					}
					env := map[string]string{"CGO_ENABLED": "1"} // the golang image's default: it has a C compiler
					for k, v := range s.env {
						env[k] = v
					}
					for _, kv := range strings.Fields(m[1]) {
						k, v, _ := strings.Cut(kv, "=")
						env[k] = v
					}
					for k, v := range env {
						im.buildEnv = append(im.buildEnv, k+"="+v)
					}
				}
			}
		}
	}
	if im.build == nil || im.buildArgs == nil {
		t.Fatal("Dockerfile: the final stage copies no binary that a build stage's `go build -o` makes")
	}

	dep, err := os.ReadFile(filepath.Join(root, "deploy/k8s/deployment.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(dep, &im.deployment); err != nil {
		t.Fatalf("deployment.yaml: %v", err)
	}
	cm, err := os.ReadFile(filepath.Join(root, "deploy/k8s/configmap.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(cm, &im.configMap); err != nil {
		t.Fatalf("configmap.yaml: %v", err)
	}
	return im
}

// TestDockerfile: a static build on the Go of go.mod, a distroless (or
// empty) final image, a non-root user, the ports tether listens on, and an
// ENTRYPOINT that reads the configuration where the Deployment mounts it.
func TestDockerfile(t *testing.T) {
	im := readImage(t)

	mod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	goVersion := regexp.MustCompile(`(?m)^go (\S+)$`).FindSubmatch(mod)
	if goVersion == nil {
		t.Fatal("go.mod: no go line")
	}
	if want := "golang:" + string(goVersion[1]); im.build.base != want && !strings.HasPrefix(im.build.base, want+"-") {
		t.Errorf("build stage FROM %s, want %s (go.mod's go version), optionally -<distribution>", im.build.base, want)
	}
	if !slices.Contains(im.buildEnv, "CGO_ENABLED=0") {
		t.Error("build stage: CGO_ENABLED=0 not set; the final image has no C library")
	}
	if !slices.Contains(im.buildArgs, "-trimpath") || !slices.Contains(im.buildArgs, "./cmd/tether") {
		t.Errorf("go build %v: want -trimpath and ./cmd/tether", im.buildArgs)
	}

	if b := im.final.base; !strings.HasPrefix(b, "gcr.io/distroless/static") && b != "scratch" {
		t.Errorf("final stage FROM %s, want gcr.io/distroless/static… or scratch", b)
	}
	user, _, _ := strings.Cut(im.final.user, ":")
	if uid, err := strconv.Atoi(user); (err != nil && user != "nonroot") || (err == nil && uid == 0) || user == "" {
		t.Errorf("final stage USER %q, want a non-root user (65532 is distroless's nonroot)", im.final.user)
	}

	// ENTRYPOINT: the binary, serve, and the configuration file the
	// Deployment's ConfigMap volume provides.
	ep := im.final.entrypoint
	if len(ep) != 4 || ep[0] != im.binary || ep[1] != "serve" || ep[2] != "--config" {
		t.Fatalf("ENTRYPOINT %q, want [%q, serve, --config, FILE]", ep, im.binary)
	}
	cfgPath := ep[3]
	pod := im.deployment.Spec.Template.Spec
	volume := map[string]string{} // volume name → ConfigMap
	for _, v := range pod.Volumes {
		if v.ConfigMap != nil {
			volume[v.Name] = v.ConfigMap.Name
		}
	}
	mounted := false
	for _, c := range pod.Containers {
		if len(c.Command) > 0 || len(c.Args) > 0 {
			t.Errorf("container %s sets command or args: the image's ENTRYPOINT is what runs", c.Name)
		}
		for _, vm := range c.VolumeMounts {
			if volume[vm.Name] == im.configMap.Name && path.Join(vm.MountPath, path.Base(cfgPath)) == cfgPath {
				mounted = true
			}
		}
	}
	if !mounted {
		t.Errorf("ENTRYPOINT reads %s, but the Deployment mounts no ConfigMap %s in %s", cfgPath, im.configMap.Name, path.Dir(cfgPath))
	}
	toml, ok := im.configMap.Data[path.Base(cfgPath)]
	if !ok {
		t.Fatalf("ConfigMap %s has no key %s (the file ENTRYPOINT reads)", im.configMap.Name, path.Base(cfgPath))
	}
	cfg, err := config.Parse([]byte(toml))
	if err != nil {
		t.Fatalf("ConfigMap %s: %v", im.configMap.Name, err)
	}

	// EXPOSE lists the ports of the configurations the image runs with:
	// the Kubernetes ConfigMap's, and deploy/compose's, whose tether also
	// serves ADS (the ConfigMap's is off: the Istio gateway does not use it).
	composeTOML, err := os.ReadFile(filepath.Join(root, "deploy/compose/tether.toml"))
	if err != nil {
		t.Fatal(err)
	}
	compose, err := config.Parse(composeTOML)
	if err != nil {
		t.Fatalf("deploy/compose/tether.toml: %v", err)
	}
	var want []string
	for _, c := range []config.Config{cfg, compose} {
		for _, a := range []string{c.Server.ExtProcAddr, c.XDS.Addr, c.Server.AdminAddr} {
			if _, p, err := net.SplitHostPort(a); err == nil && !slices.Contains(want, p) {
				want = append(want, p)
			}
		}
	}
	got := slices.Clone(im.final.expose)
	for i, p := range got {
		got[i] = strings.TrimSuffix(p, "/tcp")
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("EXPOSE %v, want the configured ports %v", im.final.expose, want)
	}
}

// dockerignore is the exclusion list of a build context.
type dockerignore []string

func readDockerignore(t *testing.T) dockerignore {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	var d dockerignore
	for _, l := range strings.Split(string(data), "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		neg := strings.HasPrefix(l, "!")
		l = path.Clean(strings.TrimPrefix(strings.TrimPrefix(l, "!"), "/"))
		if neg {
			l = "!" + l
		}
		d = append(d, l)
	}
	return d
}

// excluded says whether Docker leaves rel (slash-separated, relative to the
// context) out: the last pattern that matches it or a parent decides.
func (d dockerignore) excluded(rel string) bool {
	out := false
	for _, p := range d {
		neg := strings.HasPrefix(p, "!")
		p = strings.TrimPrefix(p, "!")
		if matchPath(p, rel) {
			out = !neg
		}
	}
	return out
}

// matchPath matches a pattern against rel or one of its parents; a leading
// "**/" matches any number of directories.
func matchPath(pattern, rel string) bool {
	parts := strings.Split(rel, "/")
	for n := 1; n <= len(parts); n++ {
		prefix := strings.Join(parts[:n], "/")
		if ok, _ := path.Match(pattern, prefix); ok {
			return true
		}
		if sub, ok := strings.CutPrefix(pattern, "**/"); ok {
			for i := 0; i < n; i++ {
				if ok, _ := path.Match(sub, strings.Join(parts[i:n], "/")); ok {
					return true
				}
			}
		}
	}
	return false
}

func TestDockerignore(t *testing.T) {
	d := readDockerignore(t)
	for _, tc := range []struct {
		rel  string
		want bool
	}{
		{"go.mod", false}, {"go.sum", false}, {"cmd/tether/main.go", false}, {"xds/resources.go", false},
		{".git/config", true}, {".tools/envoy/envoy/_bin/envoy", true}, {"bin/tether", true}, {"tether", true},
		{"extproc.test", true}, {"server/x.test", true},
	} {
		if got := d.excluded(tc.rel); got != tc.want {
			t.Errorf(".dockerignore: %s excluded %v, want %v", tc.rel, got, tc.want)
		}
	}
}

// static says why the ELF binary at p is not statically linked: it asks
// for a program interpreter (the dynamic loader) or names shared
// libraries. distroless/static and scratch have neither.
func static(p string) error {
	f, err := elf.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is dynamically linked: it asks for a program interpreter", p)
		}
	}
	if libs, err := f.ImportedLibraries(); err == nil && len(libs) > 0 {
		return fmt.Errorf("%s is dynamically linked: it needs %v", p, libs)
	}
	return nil
}

// TestStaticRefusesDynamic: the check sees a dynamically linked binary.
func TestStaticRefusesDynamic(t *testing.T) {
	for _, p := range []string{"/bin/sh", "/bin/ls", "/usr/bin/env"} {
		if _, err := os.Stat(p); err != nil {
			continue
		}
		err := static(p)
		if err == nil || !strings.Contains(err.Error(), "dynamically linked") {
			t.Errorf("static(%s) = %v, want dynamically linked", p, err)
		}
		return
	}
	// Debian has all three; under CI=true their absence fails the test.
	testenv.Require(t, "a dynamically linked system binary (/bin/sh)", errors.New("none of /bin/sh, /bin/ls, /usr/bin/env exists"))
}

// buildContext copies what .dockerignore lets into the build context.
func buildContext(t *testing.T, dst string) {
	t.Helper()
	d := readDockerignore(t)
	// Other tests may add or remove files in the tree meanwhile: a file
	// gone by the time it is read is skipped.
	gone := func(err error) bool { return errors.Is(err, fs.ErrNotExist) }
	err := filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
		if gone(err) {
			return nil
		}
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil || rel == "." {
			return err
		}
		rel = filepath.ToSlash(rel)
		if d.excluded(rel) {
			if e.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		target := filepath.Join(dst, rel)
		switch {
		case e.IsDir():
			return os.MkdirAll(target, 0o755)
		case e.Type().IsRegular():
			if err := copyFile(p, target, 0o644); !gone(err) {
				return err
			}
		}
		return nil // symlinks, sockets: not part of the module
	})
	if err != nil {
		t.Fatalf("build context: %v", err)
	}
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// TestStaticBinaryRunsAlone builds the binary as the Dockerfile's build
// stage does, from the build context .dockerignore leaves, checks that it
// is statically linked, then runs `config validate` and `serve` from a
// directory holding only the binary and its configuration, with an empty
// environment, the way the image runs it: /healthz answers, and SIGTERM
// stops it cleanly.
func TestStaticBinaryRunsAlone(t *testing.T) {
	if testing.Short() && os.Getenv("CI") != "true" {
		t.Skip("builds tether: skipped with -short (never under CI=true)")
	}
	im := readImage(t)
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go command: %v", err)
	}

	ctxDir := t.TempDir()
	buildContext(t, ctxDir)
	outDir := t.TempDir()
	bin := filepath.Join(outDir, "tether")
	// A cold build cache takes minutes on a busy machine; a warm one, seconds.
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	args := append([]string{"build", "-o", bin}, im.buildArgs...)
	build := exec.CommandContext(ctx, goBin, args...)
	build.Dir = ctxDir
	build.Env = append(os.Environ(), im.buildEnv...)
	start := time.Now()
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go %s (%v): %v\n%s", strings.Join(args, " "), im.buildEnv, err, out)
	}
	t.Logf("go %s: %v", strings.Join(args, " "), time.Since(start).Round(time.Millisecond))

	if err := static(bin); err != nil {
		t.Fatal(err)
	}

	// The image's file system, in miniature: the binary where the final
	// stage copies it and the configuration where the Deployment mounts it.
	fsRoot := t.TempDir()
	binary := filepath.Join(fsRoot, filepath.FromSlash(im.binary))
	cfgPath := filepath.Join(fsRoot, filepath.FromSlash(im.final.entrypoint[3]))
	if err := os.MkdirAll(filepath.Dir(cfgPath), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := copyFile(bin, binary, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfgPath, []byte(`
[server]
extproc_addr = "127.0.0.1:0"
admin_addr = "127.0.0.1:0"
drain_delay = "1s"
drain_timeout = "2s"

[redis]
url = "embedded"

[xds]
addr = "127.0.0.1:0"

[[instances]]
name = "gpu-1"
address = "127.0.0.1:9"
`), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) *exec.Cmd {
		c := exec.Command(binary, args...)
		c.Dir = fsRoot
		c.Env = []string{} // nothing from this machine
		return c
	}

	out, err := run("config", "validate", cfgPath).CombinedOutput()
	if err != nil || !strings.Contains(string(out), ": ok") {
		t.Fatalf("tether config validate: %v\n%s", err, out)
	}
	bad := filepath.Join(fsRoot, "bad.toml")
	if err := os.WriteFile(bad, []byte("[server]\nadmin_adr = \"127.0.0.1:0\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := run("config", "validate", bad).CombinedOutput(); err == nil || !strings.Contains(string(out), "server.admin_adr") {
		t.Errorf("tether config validate of a misspelt key: %v\n%s", err, out)
	}
	if err := os.Remove(bad); err != nil {
		t.Fatal(err)
	}

	// serve, with the ENTRYPOINT's arguments (the config path under fsRoot).
	serve := run(im.final.entrypoint[1], im.final.entrypoint[2], cfgPath)
	stderr, err := serve.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := serve.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	admin := make(chan string, 1)
	logs := make(chan []string, 1)
	go func() {
		var lines []string
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			lines = append(lines, sc.Text())
			var rec struct{ Message, Admin string }
			if json.Unmarshal(sc.Bytes(), &rec) == nil && rec.Message == "tether ready" {
				admin <- rec.Admin
			}
		}
		logs <- lines
	}()
	go func() { exited <- serve.Wait() }()
	stopped := false
	defer func() {
		if !stopped {
			_ = serve.Process.Kill()
			<-exited
		}
	}()
	logsAfterExit := func() string {
		select {
		case l := <-logs:
			return strings.Join(l, "\n")
		case <-time.After(2 * time.Second):
			return "(no logs)"
		}
	}

	var addr string
	select {
	case addr = <-admin:
	case err := <-exited:
		stopped = true
		t.Fatalf("tether serve exited before it was ready: %v\n%s", err, logsAfterExit())
	case <-time.After(20 * time.Second):
		t.Fatal("tether serve: not ready within 20s")
	}
	client := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := client.Get("http://" + addr + "/healthz")
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && string(body) == "ok\n" {
				break
			}
			err = fmt.Errorf("%d %q", resp.StatusCode, body)
		}
		if time.Now().After(deadline) {
			t.Fatalf("/healthz: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}

	if err := serve.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		stopped = true
		l := logsAfterExit()
		if err != nil {
			t.Fatalf("tether serve after SIGTERM: %v\n%s", err, l)
		}
		if !strings.Contains(l, "tether stopped") {
			t.Errorf("no \"tether stopped\" in the logs:\n%s", l)
		}
	case <-time.After(10 * time.Second): // drain_delay 1s, drain_timeout 2s, ADS 1s, admin 2s
		t.Fatal("tether serve did not stop within 10s of SIGTERM")
	}
}
