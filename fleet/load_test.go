package fleet

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestMergeLoad(t *testing.T) {
	t0 := time.Unix(1_750_000_000, 0)
	reading := func(waiting int, at time.Time) EngineReading { return EngineReading{Waiting: waiting, At: at} }
	empty := func() LoadState {
		return LoadState{Active: map[string]int{}, InFlight: map[string]int{}, Queue: map[string]int{}, Drained: map[string]bool{}, Engine: map[string]EngineReading{}}
	}
	with := func(f func(*LoadState)) LoadState { st := empty(); f(&st); return st }
	tests := []struct {
		name      string
		instances []string
		reports   []LoadReport
		want      LoadState
	}{
		{"no reports", []string{"a"}, nil, empty()},
		{"no instances", nil, []LoadReport{{Replica: "r2", InFlight: map[string]int{"a": 1}, Queue: map[string]int{"a": 2}}},
			with(func(st *LoadState) { st.Replicas = 1 })},
		{"self only: its queue counts, nothing else", []string{"a"},
			[]LoadReport{{Replica: "me", InFlight: map[string]int{"a": 5}, Queue: map[string]int{"a": 3}, Engine: map[string]EngineReading{"a": reading(1, t0)}}},
			with(func(st *LoadState) { st.Queue["a"] = 3 })},
		{"in flight summed without self", []string{"a", "b"}, []LoadReport{
			{Replica: "me", InFlight: map[string]int{"a": 100}},
			{Replica: "r2", InFlight: map[string]int{"a": 1, "b": 0}},
			{Replica: "r3", InFlight: map[string]int{"a": 2}},
		}, with(func(st *LoadState) { st.InFlight["a"], st.InFlight["b"], st.Replicas = 3, 0, 2 })},
		{"highest queue, self's included", []string{"a", "b"}, []LoadReport{
			{Replica: "r2", Queue: map[string]int{"a": 4, "b": 1}},
			{Replica: "me", Queue: map[string]int{"a": 2, "b": 9}},
			{Replica: "r3", Queue: map[string]int{"a": 7}},
		}, with(func(st *LoadState) { st.Queue["a"], st.Queue["b"], st.Replicas = 7, 9, 2 })},
		{"equal queues", []string{"a"}, []LoadReport{
			{Replica: "r2", Queue: map[string]int{"a": 4}},
			{Replica: "r3", Queue: map[string]int{"a": 4}},
		}, with(func(st *LoadState) { st.Queue["a"], st.Replicas = 4, 2 })},
		{"a zero queue is a reading", []string{"a"}, []LoadReport{{Replica: "r2", Queue: map[string]int{"a": 0}}},
			with(func(st *LoadState) { st.Queue["a"], st.Replicas = 0, 1 })},
		{"newest reading, stale one first", []string{"a"}, []LoadReport{
			{Replica: "r2", Engine: map[string]EngineReading{"a": reading(1, t0)}},
			{Replica: "r3", Engine: map[string]EngineReading{"a": reading(2, t0.Add(time.Second))}},
		}, with(func(st *LoadState) { st.Engine["a"], st.Replicas = reading(2, t0.Add(time.Second)), 2 })},
		{"newest reading, stale one last", []string{"a"}, []LoadReport{
			{Replica: "r3", Engine: map[string]EngineReading{"a": reading(2, t0.Add(time.Second))}},
			{Replica: "r2", Engine: map[string]EngineReading{"a": reading(1, t0)}},
		}, with(func(st *LoadState) { st.Engine["a"], st.Replicas = reading(2, t0.Add(time.Second)), 2 })},
		{"self's newer reading left out", []string{"a"}, []LoadReport{
			{Replica: "me", Engine: map[string]EngineReading{"a": reading(9, t0.Add(time.Hour))}},
			{Replica: "r2", Engine: map[string]EngineReading{"a": reading(1, t0)}},
		}, with(func(st *LoadState) { st.Engine["a"], st.Replicas = reading(1, t0), 1 })},
		{"readings at the same time: the first replica by name", []string{"a"}, []LoadReport{
			{Replica: "r3", Engine: map[string]EngineReading{"a": reading(3, t0)}},
			{Replica: "r2", Engine: map[string]EngineReading{"a": reading(2, t0)}},
			{Replica: "r4", Engine: map[string]EngineReading{"a": reading(4, t0)}},
		}, with(func(st *LoadState) { st.Engine["a"], st.Replicas = reading(2, t0), 3 })},
		{"unlisted instances left out", []string{"a"}, []LoadReport{
			{Replica: "r2", InFlight: map[string]int{"x": 1}, Queue: map[string]int{"x": 1}, Engine: map[string]EngineReading{"x": reading(1, t0)}},
			{Replica: "me", Queue: map[string]int{"y": 1}},
		}, with(func(st *LoadState) { st.Replicas = 1 })},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := MergeLoad("me", tt.instances, tt.reports)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("MergeLoad (-want +got):\n%s", diff)
			}
		})
	}
}
