// Package image_test checks the container image recipes without a
// container runtime: no image is built on these machines. There are two:
// the product's (the Dockerfile and .dockerignore at the repository root:
// tether alone) and the lab's (lab/Dockerfile and
// lab/Dockerfile.dockerignore: tether-lab, whose emulate the compose
// stack's instances run). For each it reads the Dockerfile, builds the
// binary the way its build stage does from the files the ignore file lets
// into the build context, checks the binary is statically linked (the final
// image has no libc), and runs it the way the image does from a directory
// holding nothing but the binary (and, for tether, its configuration).
//
// The repository holds three Go modules (the product at the root, lab/ and
// e2e/, joined by go.work for development): each recipe builds its own
// module, in the directory of that module's go.mod (the build stage's
// WORKDIR), without the workspace.
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

// The two recipes, from the repository root: the Dockerfile and the ignore
// file that decides its build context. (BuildKit reads
// <Dockerfile>.dockerignore next to a Dockerfile instead of the context's
// .dockerignore.)
var (
	product = recipeFiles{dockerfile: "Dockerfile", ignore: ".dockerignore", module: ".", pkg: "./cmd/tether"}
	lab     = recipeFiles{dockerfile: "lab/Dockerfile", ignore: "lab/Dockerfile.dockerignore", module: "lab", pkg: "./cmd/tether-lab"}
)

type recipeFiles struct {
	dockerfile, ignore string
	module             string // the directory of the go.mod it builds, from the repository root
	pkg                string // what the build stage compiles, from that directory
}

// stage is one FROM … section of a Dockerfile.
type stage struct {
	base, name string
	env        map[string]string
	workdir    string    // the WORKDIR in effect, "/" before the first
	runs       []command // RUN's lines
	copies     []command // COPY's arguments, flags included
	user       string
	expose     []string
	entrypoint []string
}

// command is a RUN's line or a COPY's arguments, and the WORKDIR it runs
// in.
type command struct {
	args string
	dir  string
}

// words are a COPY's words, flags included.
func (c command) words() []string { return strings.Fields(c.args) }

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
			s := &stage{base: f[0], env: map[string]string{}, workdir: "/"}
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
		case "WORKDIR":
			s.workdir = inDir(s.workdir, args)
		case "RUN":
			s.runs = append(s.runs, command{args, s.workdir})
		case "COPY":
			s.copies = append(s.copies, command{args, s.workdir})
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

// recipe is what the tests read from one Dockerfile.
type recipe struct {
	files        recipeFiles
	build, final *stage
	buildArgs    []string // go build's arguments, -o and its value removed
	buildEnv     []string // the build stage's ENV, CGO_ENABLED always set
	buildDir     string   // where go build runs, relative to the build context
	binary       string   // where the final stage puts the binary
}

// image is the product's recipe and the manifests that run it.
type image struct {
	*recipe
	deployment *appsv1.Deployment
	configMap  *corev1.ConfigMap
}

var goBuild = regexp.MustCompile(`(?:^|&&|;)\s*((?:[A-Z_]+=\S+\s+)*)go build (.*?)(?:&&|;|$)`)

func readRecipe(t *testing.T, files recipeFiles) *recipe {
	t.Helper()
	name := files.dockerfile
	data, err := os.ReadFile(filepath.Join(root, name))
	if err != nil {
		t.Fatal(err)
	}
	stages, err := parseDockerfile(string(data))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if len(stages) < 2 {
		t.Fatalf("%s: %d stage(s), want a build stage and a final stage", name, len(stages))
	}
	im := &recipe{files: files, final: stages[len(stages)-1]}

	// The final stage copies the binary from a build stage.
	for _, c := range im.final.copies {
		from := ""
		var rest []string
		for _, w := range c.words() {
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
					m := goBuild.FindStringSubmatch(run.args)
					if m == nil {
						continue
					}
					args, err := words(m[2])
					if err != nil {
						t.Fatalf("%s: RUN %s: %v", name, run.args, err)
					}
					im.buildDir = contextDir(t, name, s, run.dir)
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
						t.Fatalf("%s: go build writes %q, the final stage copies %q", name, out, rest[0])
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
		t.Fatalf("%s: the final stage copies no binary that a build stage's `go build -o` makes", name)
	}
	return im
}

// inDir is p in the image's file system, relative to dir unless absolute
// (as WORKDIR and COPY's destination read it).
func inDir(dir, p string) string {
	if path.IsAbs(p) {
		return path.Clean(p)
	}
	return path.Join(dir, p)
}

// contextDir is the directory of the build context (slash-separated,
// relative to its root) that the build stage's dir holds: the stage copies
// the whole context (COPY . DEST) to DEST, and dir is DEST or below it.
func contextDir(t *testing.T, dockerfile string, s *stage, dir string) string {
	t.Helper()
	for _, c := range s.copies {
		w := c.words()
		if len(w) != 2 || w[0] != "." {
			continue
		}
		dest := inDir(c.dir, w[1])
		if rel, ok := strings.CutPrefix(dir, dest); ok && (rel == "" || strings.HasPrefix(rel, "/") || dest == "/") {
			if rel = strings.Trim(rel, "/"); rel != "" {
				return rel
			}
			return "."
		}
		t.Fatalf("%s: go build runs in %s, outside %s where the build context is copied", dockerfile, dir, dest)
	}
	t.Fatalf("%s: the build stage copies no whole build context (COPY . DEST) for go build to run in", dockerfile)
	return ""
}

func readImage(t *testing.T) *image {
	t.Helper()
	im := &image{recipe: readRecipe(t, product)}
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
	checkRecipe(t, im.recipe)

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

// checkRecipe: the build stage runs the Go of its module's go.mod, in that
// module's directory, with cgo off, without the workspace (go.work names
// modules the build context leaves out) and -trimpath on the recipe's
// package; the final stage is distroless/static (or empty) and runs as a
// non-root user.
func checkRecipe(t *testing.T, im *recipe) {
	t.Helper()
	if im.buildDir != im.files.module {
		t.Errorf("%s: go build runs in %s of the build context, want %s (the module it builds)", im.files.dockerfile, im.buildDir, im.files.module)
	}
	gomod := path.Join(im.files.module, "go.mod")
	mod, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(gomod)))
	if err != nil {
		t.Fatal(err)
	}
	goVersion := regexp.MustCompile(`(?m)^go (\S+)$`).FindSubmatch(mod)
	if goVersion == nil {
		t.Fatalf("%s: no go line", gomod)
	}
	if !slices.Contains(im.buildEnv, "GOWORK=off") {
		t.Errorf("%s: build stage: GOWORK=off not set; go.work names modules this build context leaves out", im.files.dockerfile)
	}
	if want := "golang:" + string(goVersion[1]); im.build.base != want && !strings.HasPrefix(im.build.base, want+"-") {
		t.Errorf("%s: build stage FROM %s, want %s (%s's go version), optionally -<distribution>", im.files.dockerfile, im.build.base, want, gomod)
	}
	if !slices.Contains(im.buildEnv, "CGO_ENABLED=0") {
		t.Errorf("%s: build stage: CGO_ENABLED=0 not set; the final image has no C library", im.files.dockerfile)
	}
	if !slices.Contains(im.buildArgs, "-trimpath") || !slices.Contains(im.buildArgs, im.files.pkg) {
		t.Errorf("%s: go build %v: want -trimpath and %s", im.files.dockerfile, im.buildArgs, im.files.pkg)
	}

	if b := im.final.base; !strings.HasPrefix(b, "gcr.io/distroless/static") && b != "scratch" {
		t.Errorf("%s: final stage FROM %s, want gcr.io/distroless/static… or scratch", im.files.dockerfile, b)
	}
	user, _, _ := strings.Cut(im.final.user, ":")
	if uid, err := strconv.Atoi(user); (err != nil && user != "nonroot") || (err == nil && uid == 0) || user == "" {
		t.Errorf("%s: final stage USER %q, want a non-root user (65532 is distroless's nonroot)", im.files.dockerfile, im.final.user)
	}
}

// TestLabDockerfile: the lab's image is built like the product's, from
// ./cmd/tether-lab in the lab's module (lab/), and runs tether-lab: docker-compose.yml's instances
// give it `emulate …` as their command.
func TestLabDockerfile(t *testing.T) {
	im := readRecipe(t, lab)
	checkRecipe(t, im)
	if ep := im.final.entrypoint; len(ep) != 1 || ep[0] != im.binary || path.Base(im.binary) != "tether-lab" {
		t.Errorf("%s: ENTRYPOINT %q, want [%q], the tether-lab binary the final stage copies", lab.dockerfile, ep, im.binary)
	}
}

// dockerignore is the exclusion list of a build context.
type dockerignore []string

func readDockerignore(t *testing.T, file string) dockerignore {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, file))
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
	d := readDockerignore(t, product.ignore)
	for _, tc := range []struct {
		rel  string
		want bool
	}{
		{"go.mod", false}, {"go.sum", false}, {"cmd/tether/main.go", false}, {"xds/resources.go", false},
		{".git/config", true}, {".tools/envoy/envoy/_bin/envoy", true}, {"bin/tether", true}, {"tether", true},
		{"extproc.test", true}, {"server/x.test", true},
		// The lab stays out of the product's context: tether cannot import it.
		{"lab/emulator/serve.go", true}, {"lab/cmd/tether-lab/main.go", true}, {"lab/go.mod", true},
		// So do the e2e tests' module and the workspace that names both.
		{"e2e/go.mod", true}, {"go.work", true}, {"go.work.sum", true},
	} {
		if got := d.excluded(tc.rel); got != tc.want {
			t.Errorf("%s: %s excluded %v, want %v", product.ignore, tc.rel, got, tc.want)
		}
	}
	d = readDockerignore(t, lab.ignore)
	for _, tc := range []struct {
		rel  string
		want bool
	}{
		{"go.mod", false}, {"go.sum", false}, {"lab/go.mod", false}, {"lab/go.sum", false},
		{"lab/cmd/tether-lab/main.go", false}, {"lab/emulator/serve.go", false}, {"xds/resources.go", false},
		{".git/config", true}, {".tools/envoy/envoy/_bin/envoy", true}, {"bin/tether-lab", true}, {"lab/x.test", true},
		{"e2e/go.mod", true}, {"go.work", true},
	} {
		if got := d.excluded(tc.rel); got != tc.want {
			t.Errorf("%s: %s excluded %v, want %v", lab.ignore, tc.rel, got, tc.want)
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

// buildContext copies what the recipe's ignore file lets into the build
// context.
func buildContext(t *testing.T, files recipeFiles, dst string) {
	t.Helper()
	d := readDockerignore(t, files.ignore)
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
		return errors.Join(err, out.Close())
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
	bin := buildBinary(t, im.recipe)

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
	serve, addr := startLogged(t, run(im.final.entrypoint[1], im.final.entrypoint[2], cfgPath), "tether serve", "tether ready", "admin")
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

	// drain_delay 1s, drain_timeout 2s, ADS 1s, admin 2s
	if l := serve.terminate(t, 10*time.Second); !strings.Contains(l, "tether stopped") {
		t.Errorf("no \"tether stopped\" in the logs:\n%s", l)
	}
}

// buildBinary builds a recipe's binary the way its build stage does, from
// the build context its ignore file leaves, and checks that it is
// statically linked.
func buildBinary(t *testing.T, im *recipe) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go command: %v", err)
	}
	ctxDir := t.TempDir()
	buildContext(t, im.files, ctxDir)
	bin := filepath.Join(t.TempDir(), path.Base(im.binary))
	// A cold build cache takes minutes on a busy machine; a warm one, seconds.
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	args := append([]string{"build", "-o", bin}, im.buildArgs...)
	build := exec.CommandContext(ctx, goBin, args...)
	build.Dir = filepath.Join(ctxDir, filepath.FromSlash(im.buildDir))
	build.Env = append(os.Environ(), im.buildEnv...)
	start := time.Now()
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("%s: go %s (%v): %v\n%s", im.files.dockerfile, strings.Join(args, " "), im.buildEnv, err, out)
	}
	t.Logf("%s: go %s: %v", im.files.dockerfile, strings.Join(args, " "), time.Since(start).Round(time.Millisecond))
	if err := static(bin); err != nil {
		t.Fatal(err)
	}
	return bin
}

// process is a binary a test started, its JSON logs (stderr) read line
// by line.
type process struct {
	name    string
	cmd     *exec.Cmd
	exited  chan error
	logs    chan []string
	stopped bool
}

// startLogged starts cmd and waits up to 20 s for its log line whose
// message is ready; it returns that line's field key (an address). The
// process is killed when the test ends, unless terminate stopped it.
func startLogged(t *testing.T, cmd *exec.Cmd, name, ready, key string) (*process, string) {
	t.Helper()
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &process{name: name, cmd: cmd, exited: make(chan error, 1), logs: make(chan []string, 1)}
	found := make(chan string, 1)
	read := make(chan struct{})
	go func() {
		defer close(read)
		var lines []string
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			lines = append(lines, sc.Text())
			var rec map[string]any
			if json.Unmarshal(sc.Bytes(), &rec) == nil && rec["message"] == ready {
				v, _ := rec[key].(string)
				select {
				case found <- v:
				default:
				}
			}
		}
		p.logs <- lines
	}()
	// Wait closes the pipe once the process exits, so it runs only after
	// the reader has seen EOF: otherwise the last lines may be lost.
	go func() { <-read; p.exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if !p.stopped {
			_ = cmd.Process.Kill()
			_ = <-p.exited // killed: the error says so
		}
	})
	select {
	case addr := <-found:
		return p, addr
	case err := <-p.exited:
		p.stopped = true
		t.Fatalf("%s exited before it was ready: %v\n%s", name, err, p.logsAfterExit())
	case <-time.After(20 * time.Second):
		t.Fatalf("%s: not ready within 20s", name)
	}
	return nil, ""
}

func (p *process) logsAfterExit() string {
	select {
	case l := <-p.logs:
		return strings.Join(l, "\n")
	case <-time.After(2 * time.Second):
		return "(no logs)"
	}
}

// terminate sends SIGTERM and waits up to within for a clean exit; it
// returns the logs.
func (p *process) terminate(t *testing.T, within time.Duration) string {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-p.exited:
		p.stopped = true
		l := p.logsAfterExit()
		if err != nil {
			t.Fatalf("%s after SIGTERM: %v\n%s", p.name, err, l)
		}
		return l
	case <-time.After(within):
		t.Fatalf("%s did not stop within %v of SIGTERM", p.name, within)
	}
	return ""
}

// TestLabBinaryRunsAlone builds tether-lab as lab/Dockerfile's build stage
// does and runs `emulate` the way docker-compose.yml's instances do, from a
// directory holding only the binary, with an empty environment: it
// refuses an address on every interface without --allow-non-loopback,
// serves an instance (/healthz, a chat completion that names it), and
// SIGTERM stops it cleanly.
func TestLabBinaryRunsAlone(t *testing.T) {
	if testing.Short() && os.Getenv("CI") != "true" {
		t.Skip("builds tether-lab: skipped with -short (never under CI=true)")
	}
	im := readRecipe(t, lab)
	bin := buildBinary(t, im)
	fsRoot := t.TempDir()
	binary := filepath.Join(fsRoot, filepath.FromSlash(im.binary))
	if err := copyFile(bin, binary, 0o755); err != nil {
		t.Fatal(err)
	}
	run := func(ctx context.Context, args ...string) *exec.Cmd {
		c := exec.CommandContext(ctx, binary, append(slices.Clone(im.final.entrypoint[1:]), args...)...)
		c.Dir = fsRoot
		c.Env = []string{} // nothing from this machine
		return c
	}

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := run(ctx, "emulate", "--instance", "lab-1=0.0.0.0:0").CombinedOutput()
	if err == nil || ctx.Err() != nil || !strings.Contains(string(out), "0.0.0.0:0") || !strings.Contains(string(out), "loopback") {
		t.Errorf("tether-lab emulate on 0.0.0.0 without --allow-non-loopback: %v, want a refusal naming the address\n%s", err, out)
	}

	emulate, addr := startLogged(t, run(context.Background(), "emulate", "--instance", "lab-1=127.0.0.1:0", "--profile", "fixed", "--latency", "1ms"),
		"tether-lab emulate", "emulated instance listening", "addr")
	client := &http.Client{Timeout: 5 * time.Second}
	resp, err := client.Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatalf("/healthz: %v", err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/healthz: %s", resp.Status)
	}
	resp, err = client.Post("http://"+addr+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"llama-3.1-8b","messages":[{"role":"user","content":"hello"}]}`))
	if err != nil {
		t.Fatalf("chat completion: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("x-instance") != "lab-1" {
		t.Errorf("chat completion: %s, x-instance %q, want 200 from lab-1\n%s", resp.Status, resp.Header.Get("x-instance"), body)
	}
	emulate.terminate(t, 10*time.Second)
}

// TestProductImageCarriesNoLab lists, in each recipe's build context and
// with its build flags, the packages its binary is made of: tether's hold
// nothing of the lab (lab/, and gonum, which only the lab's charts use)
// and no miniredis (a test double: "embedded" is store/memory);
// tether-lab's hold the lab's, which shows the check sees them.
func TestProductImageCarriesNoLab(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go command: %v", err)
	}
	labOnly := []string{"github.com/tetherproxy/tether/lab/", "gonum.org/"}
	notInProduct := append([]string{"github.com/alicebob/miniredis"}, labOnly...)
	deps := func(files recipeFiles, prefixes []string) []string {
		im := readRecipe(t, files)
		ctxDir := t.TempDir()
		buildContext(t, files, ctxDir)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		list := exec.CommandContext(ctx, goBin, append([]string{"list", "-deps"}, im.buildArgs...)...)
		list.Dir = filepath.Join(ctxDir, filepath.FromSlash(im.buildDir))
		list.Env = append(os.Environ(), im.buildEnv...)
		out, err := list.Output()
		if err != nil {
			var stderr []byte
			if ee, ok := errors.AsType[*exec.ExitError](err); ok {
				stderr = ee.Stderr
			}
			t.Fatalf("%s: go list -deps %v in its build context: %v\n%s", files.dockerfile, im.buildArgs, err, stderr)
		}
		var found []string
		for _, p := range strings.Fields(string(out)) {
			for _, prefix := range prefixes {
				if strings.HasPrefix(p, prefix) {
					found = append(found, p)
				}
			}
		}
		return found
	}
	if found := deps(product, notInProduct); len(found) > 0 {
		t.Errorf("%s: tether is built from lab or test packages: %v", product.dockerfile, found)
	}
	found := deps(lab, labOnly)
	for _, prefix := range labOnly {
		if !slices.ContainsFunc(found, func(p string) bool { return strings.HasPrefix(p, prefix) }) {
			t.Errorf("%s: no %s… package in tether-lab's: the check cannot see the lab (found %v)", lab.dockerfile, prefix, found)
		}
	}
}
